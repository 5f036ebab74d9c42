# Sourced by the device scripts (scripts/gpu_*.sh) from the repo root: $OUT (default ./gpu_out)
# made, PYTHONPATH=. with the system python3 (the project venv does not travel), the carried
# wheels of .whl/ (msgspec, pyzmq, ...) installed into /tmp/site and put on PYTHONPATH when
# present, and $OUT/env.txt: GPU, driver, clocks, torch and triton versions, the commit. Defines
# `run NAME TIMEOUT CMD...`: CMD under a timeout, its exit code, time and output tail appended to
# $OUT/bench.log (and printed).
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git log -1 --format='commit %H %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"

run() {  # run NAME TIMEOUT CMD...
  local name=$1 limit=$2 t0 rc; shift 2; t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/.$name.log" 2>&1
  rc=$?
  { echo "== $name: rc=$rc (124: timeout) in $(( $(date +%s) - t0 )) s"; tail -30 "$OUT/.$name.log"; } | tee -a "$OUT/bench.log"
  rm -f "$OUT/.$name.log"
}
