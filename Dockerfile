# Kestrel image: one image, every service (the compose file picks the subcommand).
# BASE_IMAGE: any Debian-based image with Python >= 3.11 (default: the official slim image).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# TORCH_SPEC: which torch to install ("torch==2.13.0" for the CPU build where it is at hand).
ARG TORCH_SPEC=torch
# PIP_ARGS: extra pip options, e.g. "--no-index --find-links /wheels" for an offline build.
ARG PIP_ARGS=""
WORKDIR /app
COPY wheelhouse* /wheels/
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY kernels kernels
RUN python3 -m pip install --no-cache-dir ${PIP_ARGS} "${TORCH_SPEC}" \
 && python3 -m pip install --no-cache-dir ${PIP_ARGS} . \
 && rm -rf /wheels
ENV PYTHONUNBUFFERED=1
ENTRYPOINT []
CMD ["kestrel", "--help"]
