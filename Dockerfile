# Kestrel image: one image, every service (compose.yaml picks the subcommand).
# BASE_IMAGE: any Debian-based image with Python >= 3.11 and its venv module (default: the
# official slim image). scripts/compose_e2e.sh passes a local debootstrapped bookworm instead.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# TORCH_SPEC: which torch to install ("torch==2.13.0" for the CPU build where it is at hand).
ARG TORCH_SPEC=torch
# PIP_ARGS: extra pip options, e.g. "--no-index --find-links /tmp/wheels" for an offline build
# from a wheelhouse/ folder in the build context (scripts/compose_e2e.sh makes one).
ARG PIP_ARGS=""
# CXX_TOOLCHAIN: the Debian packages of a C++ compiler for Kestrel's CPU kernels (kernels/csrc/,
# built by torch's cpp_extension; without one the CPU path keeps PyTorch's ops), installed with
# apt unless the base image has g++ already (and python3-dev where Python.h is missing, as on a
# Debian python3; the official python images have it); empty: none.
ARG CXX_TOOLCHAIN=g++
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kestrel \
    PATH=/opt/kestrel/bin:$PATH \
    TORCH_EXTENSIONS_DIR=/opt/kestrel/torch_extensions
WORKDIR /app
RUN if [ -n "${CXX_TOOLCHAIN}" ]; then \
      pkgs=""; command -v g++ >/dev/null 2>&1 || pkgs="${CXX_TOOLCHAIN}"; \
      python3 -c "import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
        || pkgs="$pkgs python3-dev"; \
      if [ -n "$pkgs" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs \
        && rm -rf /var/lib/apt/lists/*; \
      fi; \
    fi
# A venv: Debian's own python3 refuses system-wide pip installs (PEP 668).
RUN python3 -m venv /opt/kestrel
# pyproject.toml is listed so that the COPY has a source when there is no wheelhouse/.
COPY pyproject.toml wheelhouse* /tmp/wheels/
RUN python3 -m pip install --no-cache-dir ${PIP_ARGS} "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
RUN python3 -m pip install --no-cache-dir ${PIP_ARGS} . \
 && rm -rf /tmp/wheels build *.egg-info \
 && kestrel --help >/dev/null
# The CPU kernels built now for this build machine's CPU (TORCH_EXTENSIONS_DIR), so that a
# container on the same kind of CPU loads them at once; another CPU builds its own on first use.
# Without a compiler this logs a warning and the image serves with PyTorch's ops.
RUN python3 -c "from kernels import cpu_decode, cpu_int4_vnni; cpu_decode.extension(); cpu_int4_vnni.extension()" 
# The runtime folder (KESTREL_RUNTIME_DIR in compose.yaml, the named volume kestrel-run):
# private, or every service refuses it (shared/runtime_dir.py). A new named volume takes the
# mode of this folder.
RUN mkdir -m 0700 -p /run/kestrel
ENTRYPOINT []
CMD ["kestrel", "--help"]
