#!/usr/bin/env bash
# A real `docker compose up` of compose.yaml, offline (there is no image registry here):
#   1. docker.io / docker-compose / debootstrap from apt when missing (needs root, Debian);
#      dockerd started in the background when not running (and stopped at the end only then);
#   2. a local base image: `debootstrap --variant=minbase bookworm` (with g++ and python3-dev) + `docker import`
#      (cached: skipped while the tag exists; the mirror is the host's own apt source);
#   3. a wheelhouse of the runtime deps (CPU torch included) made on the host with
#      `pip download` (cached in .cache/wheelhouse), so the image build needs no network;
#   4. the stack up, /health through the published port, one chat completion, the worker's
#      C++ CPU decode ops loaded (its log),
#      `restart frontend` (the engine and kvstore containers must keep their start time) and a
#      new request, then `down`, which must leave no container.
# Prints PASS or FAIL with the time of each phase; exit status 0 only on PASS, 77 when this
# machine cannot run Docker (not root, no apt, dockerd does not start).
# Env: KESTREL_E2E_PORT (host port, default 18000), KESTREL_E2E_BASE (base image tag),
#      KESTREL_E2E_TIMEOUT (seconds for the whole run, default 1500).
set -euo pipefail
if [ -z "${KESTREL_E2E_TIMEOUT_ARMED:-}" ]; then   # bound the whole run: re-exec under timeout(1)
  export KESTREL_E2E_TIMEOUT_ARMED=1
  exec timeout --signal=TERM --kill-after=60 "${KESTREL_E2E_TIMEOUT:-1500}" "$(readlink -f "$0")" "$@"
fi
cd "$(dirname "$0")/.."
ROOT=$PWD
PROJECT=kestrel-e2e
PORT=${KESTREL_E2E_PORT:-18000}
BASE_TAG=${KESTREL_E2E_BASE:-kestrel-base:bookworm-cxx}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=$ROOT/.venv
WHEELS_CACHE=$ROOT/.cache/wheelhouse
T0=$(date +%s)
PHASES=()
STARTED_DOCKERD=""
DOCKERD_PID=""
STACK_UP=""
RESULT=FAIL

log() { echo "[compose-e2e +$(( $(date +%s) - T0 ))s] $*"; }
phase() { PHASES+=("$1: $(( $(date +%s) - PHASE_T ))s"); PHASE_T=$(date +%s); }
fail() { log "FAIL: $*"; exit 1; }
# A missing capability (no root, no apt, dockerd cannot start) exits 77, so that CI can tell
# "cannot run here" from "ran and failed".
nocap() { log "NO DOCKER CAPABILITY: $*"; RESULT="SKIPPED (no docker capability)"; exit 77; }

if docker-compose version >/dev/null 2>&1; then DC=(docker-compose); else DC=(docker compose); fi
dc() { "${DC[@]}" -p "$PROJECT" -f "$ROOT/compose.yaml" "$@"; }

cleanup() {
  local rc=$?
  set +e
  if [ -n "$STACK_UP" ]; then
    if [ "$RESULT" != PASS ]; then
      log "service logs (tail):"
      dc logs --no-color --tail=60 2>&1 | tail -200
    fi
    dc down -v --remove-orphans -t 40 >/dev/null 2>&1
  fi
  rm -rf "$ROOT/wheelhouse"
  if [ -n "$STARTED_DOCKERD" ] && [ -n "$DOCKERD_PID" ]; then
    log "stopping the dockerd this script started (pid $DOCKERD_PID)"
    kill "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  fi
  echo "================ compose e2e: $RESULT (total $(( $(date +%s) - T0 ))s) ================"
  for p in "${PHASES[@]}"; do echo "  $p"; done
  [ "$RESULT" = PASS ] && exit 0
  case "$RESULT" in SKIPPED*) exit 77;; esac
  exit $(( rc == 0 ? 1 : rc ))
}
trap cleanup EXIT
trap 'log "FAIL: line $LINENO: $BASH_COMMAND"' ERR
trap 'log "timed out or interrupted"; exit 124' TERM INT
PHASE_T=$T0

# --- 1. docker, compose, debootstrap
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
docker-compose version >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || need+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    || nocap "missing ${need[*]} and cannot apt-get install them (needs root on Debian)"
  log "installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends "${need[@]}") >/tmp/kestrel-compose-e2e-apt.log 2>&1 \
    || nocap "apt-get install ${need[*]} failed (see /tmp/kestrel-compose-e2e-apt.log)"
  if docker-compose version >/dev/null 2>&1; then DC=(docker-compose); else DC=(docker compose); fi
fi
if ! docker info >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || nocap "dockerd is not running and this is not root"
  log "starting dockerd"
  dockerd >/tmp/kestrel-compose-e2e-dockerd.log 2>&1 &
  DOCKERD_PID=$!
  STARTED_DOCKERD=1
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || nocap "dockerd did not start (see /tmp/kestrel-compose-e2e-dockerd.log)"
fi
phase "docker ready"

# --- 2. base image
if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  log "base image $BASE_TAG cached"
else
  # The host's own Debian mirror (never a name written here), or KESTREL_DEBIAN_MIRROR.
  MIRROR=${KESTREL_DEBIAN_MIRROR:-$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
    2>/dev/null | awk '($1 == "URIs:" || $1 == "deb") && $2 !~ /security/ { print $2; exit }' || true)}
  [ -n "$MIRROR" ] || fail "no Debian mirror found in the apt sources; set KESTREL_DEBIAN_MIRROR"
  ROOTFS=$(mktemp -d /tmp/kestrel-rootfs.XXXXXX)
  log "debootstrap bookworm into $ROOTFS"
  # g++ and python3-dev (Python.h): the image's C++ CPU kernels (Dockerfile CXX_TOOLCHAIN: no apt
  # in the offline build, the base has them)
  debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates,g++ \
    bookworm "$ROOTFS" "$MIRROR" >/tmp/kestrel-compose-e2e-debootstrap.log 2>&1 \
    || { rm -rf "$ROOTFS"; fail "debootstrap failed (see /tmp/kestrel-compose-e2e-debootstrap.log)"; }
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb
  tar -C "$ROOTFS" -c . | docker import - "$BASE_TAG" >/dev/null
  rm -rf "$ROOTFS"
  log "imported $BASE_TAG"
fi
phase "base image"

# --- 3. wheelhouse (runtime deps of pyproject.toml + build backend, for the image's Python)
[ -x "$VENV/bin/pip" ] || fail "$VENV is missing: run make setup first"
REQS=$("$VENV/bin/python" - "$TORCH_SPEC" <<'EOF'
import sys, tomllib
d = tomllib.load(open("pyproject.toml", "rb"))
torch = sys.argv[1]
for r in d["project"]["dependencies"]:
    print(torch if r.split(">")[0].split("=")[0].strip() == "torch" else r)
for r in d["build-system"]["requires"]:
    print(r)
EOF
)
STAMP=$(printf '%s\n' "$REQS" | sha256sum | cut -c1-16)
if [ -f "$WHEELS_CACHE/.stamp-$STAMP" ]; then
  log "wheelhouse cached"
else
  log "pip download into $WHEELS_CACHE"
  rm -rf "$WHEELS_CACHE"; mkdir -p "$WHEELS_CACHE"
  printf '%s\n' "$REQS" >"$WHEELS_CACHE/requirements.txt"
  "$VENV/bin/pip" download -q --only-binary=:all: --implementation cp --python-version 3.11 \
    --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
    -d "$WHEELS_CACHE" -r "$WHEELS_CACHE/requirements.txt" >/tmp/kestrel-compose-e2e-pip.log 2>&1 \
    || fail "pip download failed (see /tmp/kestrel-compose-e2e-pip.log)"
  touch "$WHEELS_CACHE/.stamp-$STAMP"
fi
rm -rf "$ROOT/wheelhouse"
cp -al "$WHEELS_CACHE" "$ROOT/wheelhouse"   # hard links: the build context sees wheelhouse/
phase "wheelhouse"

# --- 4. model
"$VENV/bin/kestrel" fetch-model >/tmp/kestrel-compose-e2e-model.log 2>&1 \
  || fail "kestrel fetch-model failed (see /tmp/kestrel-compose-e2e-model.log)"
phase "model"

# --- 5. build
export KESTREL_BASE_IMAGE=$BASE_TAG KESTREL_TORCH_SPEC=$TORCH_SPEC \
  KESTREL_PIP_ARGS="--no-index --find-links /tmp/wheels" KESTREL_PORT=$PORT
log "building kestrel:local"
dc build >/tmp/kestrel-compose-e2e-build.log 2>&1 \
  || { tail -40 /tmp/kestrel-compose-e2e-build.log; fail "image build failed"; }
rm -rf "$ROOT/wheelhouse"
phase "build"

# --- 6. up, /health, one chat completion
dc down -v --remove-orphans -t 40 >/dev/null 2>&1 || true   # leftovers of an aborted run
STACK_UP=1
dc up -d >/tmp/kestrel-compose-e2e-up.log 2>&1 || { cat /tmp/kestrel-compose-e2e-up.log; fail "up failed"; }
BASE=http://127.0.0.1:$PORT
wait_health() {  # $1: deadline in seconds
  local end=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt "$end" ]; do
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 3 "$BASE/health" || true)" = 200 ] && return 0
    sleep 1
  done
  return 1
}
chat() {  # prints the reply's content; fails on anything but a 200 with a non-empty content
  curl -sf --max-time 120 "$BASE/v1/chat/completions" -H 'Content-Type: application/json' -d '{
    "model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 16,
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}' \
  | "$VENV/bin/python" -c 'import json,sys; c=json.load(sys.stdin)["choices"][0]["message"]["content"]; assert c.strip(), "empty"; print(c)'
}
started() { docker inspect -f '{{.State.Running}} {{.State.StartedAt}}' "$(dc ps -q "$1")"; }
wait_health 300 || fail "/health never returned 200 on $BASE"
phase "up + healthy"
REPLY=$(chat) || fail "chat completion failed"
log "reply: $REPLY"
phase "first request"

# The worker serves with Kestrel's C++ CPU decode ops (kernels/csrc/, built into the image by the
# Dockerfile with its compiler), not the PyTorch fallback.
dc logs --no-color worker 2>&1 | grep -Eq 'CPU decode ops \([a-z0-9]+\) loaded' \
  || fail "the worker did not load the C++ CPU decode ops: $(dc logs --no-color worker 2>&1 | grep -i 'CPU decode ops' | tail -3)"
log "worker: $(dc logs --no-color worker 2>&1 | grep -Eo 'CPU decode ops \([a-z0-9]+\) loaded' | head -1)"

# Every service's own healthcheck (compose.yaml) reports healthy.
end=$(( $(date +%s) + 90 ))
for svc in engine worker kvstore frontend; do
  until [ "$(docker inspect -f '{{.State.Health.Status}}' "$(dc ps -q $svc)")" = healthy ]; do
    [ "$(date +%s)" -lt "$end" ] || fail "$svc healthcheck not healthy: $(docker inspect -f '{{json .State.Health}}' "$(dc ps -q $svc)" | tail -c 600)"
    sleep 2
  done
done
phase "healthchecks healthy"

# --- 7. restart only the frontend
ENGINE_BEFORE=$(started engine); KV_BEFORE=$(started kvstore); FE_BEFORE=$(started frontend)
log "engine: $ENGINE_BEFORE; restarting the frontend"
dc restart frontend >/dev/null 2>&1 || fail "restart frontend failed"
[ "$(started frontend)" != "$FE_BEFORE" ] || fail "the frontend container was not restarted"
wait_health 180 || fail "/health never came back after the frontend restart"
ENGINE_AFTER=$(started engine); KV_AFTER=$(started kvstore)
[ "$ENGINE_AFTER" = "$ENGINE_BEFORE" ] || fail "engine restarted with the frontend: $ENGINE_BEFORE -> $ENGINE_AFTER"
[ "$KV_AFTER" = "$KV_BEFORE" ] || fail "kvstore restarted with the frontend: $KV_BEFORE -> $KV_AFTER"
case "$ENGINE_AFTER" in true*) ;; *) fail "engine not running: $ENGINE_AFTER";; esac
REPLY=$(chat) || fail "chat completion after the frontend restart failed"
log "reply after restart: $REPLY"
phase "frontend restart + request"

# --- 8. down leaves nothing
dc down -v --remove-orphans -t 40 >/dev/null 2>&1 || fail "down failed"
STACK_UP=""
LEFT=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
[ -z "$LEFT" ] || fail "containers left after down: $LEFT"
phase "down"
RESULT=PASS
