# syntax=docker/dockerfile:1
# One image for both processes of LoRAServe:
#   loraserve-runtime   the serving process (GPU), started by the operator's Deployments
#   loraserve-operator  the Kubernetes operator and its admission webhook (the Helm chart)
#   loraserve-fetch     downloads https:// and s3:// models (the serving pods' init containers)
#   loraserve-token-map builds an FR-Spec token map for an EAGLE draft from a corpus
# The base brings CUDA and a CUDA build of torch (with its triton); the project adds the rest.
# It is the torch and Triton the kernels were tested and measured on (bench/results/: torch
# 2.11.0+cu130, Triton 3.6.0, which torch 2.11.0 pins): pyproject's bounds, the runtime's
# start-up check (loraserve.runtime.contract.capabilities.TRITON_OLDEST) and the latest GPU results
# must agree with it (tests/packaging/test_versions.py). CUDA 13.0 needs an R580 driver.

ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG UID=10001
LABEL org.opencontainers.image.title="loraserve" \
      org.opencontainers.image.description="Many LoRA adapters on one base model, with speculative decoding" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.loraserve.entrypoints="loraserve-runtime loraserve-operator loraserve-fetch loraserve-token-map"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    HOME=/tmp \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor

# torch and triton are already in the base (CUDA build); pip keeps them because they
# satisfy pyproject's bounds (torch>=2.11, the triton extra's triton>=3.6), and the build
# fails if the runtime would refuse the Triton it ends up with.
COPY --from=build /wheels /wheels
RUN set -eux; \
    wheel="$(ls /wheels/loraserve-*.whl)"; \
    python -m pip install --no-cache-dir "${wheel}[operator,triton]"; \
    rm -rf /wheels; \
    python -c "import sys; from loraserve.runtime import capabilities as c; v = c.installed_triton_version(); sys.exit(c.triton_version_problem(v, ['LoRA', 'paged attention']) if v else 'the image has no triton')"; \
    command -v loraserve-runtime; \
    command -v loraserve-operator; \
    command -v loraserve-fetch; \
    command -v loraserve-token-map; \
    python -c "import loraserve.runtime, loraserve.kernels, loraserve.operator"

# A fixed numeric non-root user, so Kubernetes can enforce runAsNonRoot; group 0 keeps
# the image usable where the platform picks the user id (files stay group-writable).
RUN set -eux; \
    useradd --uid "${UID}" --gid 0 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin loraserve; \
    mkdir -p /cache /models /adapters; \
    chown -R "${UID}:0" /cache /models /adapters; \
    chmod -R g=u /cache /models /adapters
USER 10001
WORKDIR /tmp

# runtime API and metrics / operator webhook / operator health
EXPOSE 8000 9443 8080

# The runtime is the default; the chart runs the operator with `command: [loraserve-operator]`.
ENTRYPOINT []
CMD ["loraserve-runtime", "--help"]
