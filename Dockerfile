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
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kestrel \
    PATH=/opt/kestrel/bin:$PATH
WORKDIR /app
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
# The runtime folder (KESTREL_RUNTIME_DIR in compose.yaml, the named volume kestrel-run):
# private, or every service refuses it (shared/runtime_dir.py). A new named volume takes the
# mode of this folder.
RUN mkdir -m 0700 -p /run/kestrel
ENTRYPOINT []
CMD ["kestrel", "--help"]
