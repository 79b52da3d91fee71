# syntax=docker/dockerfile:1
# specinfer services that run models, one target (and image) each:
#   ssm-worker    specinfer-ssm-worker on port 50052 (small speculative models, token trees)
#   llm-verifier  specinfer-llm-verifier on port 50053 (the LLM, tree attention, verification)
#
#   docker build -f docker/model-service.Dockerfile --target ssm-worker -t specinfer/ssm-worker:0.1.0-cpu .
#   docker build -f docker/model-service.Dockerfile --target llm-verifier --build-arg VARIANT=cuda -t specinfer/llm-verifier:0.1.0-cuda .
#
# VARIANT=cpu (default): the CPU-only torch build. VARIANT=cuda: PyPI's CUDA 13.0 build of torch
# plus triton for the fused tree-attention kernel; run it on a host with the NVIDIA container
# toolkit and a driver that supports CUDA 13. The image's default device is its variant's
# (SPECINFER_DEVICE=cpu or cuda).
# Models are not in the image and nothing is downloaded at run time (HF_HUB_OFFLINE=1): mount the
# checkpoint folders read-only (e.g. at /models) and name them with SPECINFER_SSM / SPECINFER_LLM.

ARG VARIANT=cpu

FROM python:3.11.14-slim-bookworm AS build
ARG VARIANT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# dependencies first: these layers are rebuilt only when a requirements file changes
COPY requirements/model-service.txt requirements/torch-cpu.txt requirements/torch-cuda.txt requirements/kernels.txt requirements/
RUN pip install --no-cache-dir -r requirements/model-service.txt \
    && pip install --no-cache-dir -r "requirements/torch-${VARIANT}.txt" \
    && pip check
# CUDA only: triton for the fused tree-attention kernel, pinned in requirements/kernels.txt (the version torch declares)
RUN if [ "$VARIANT" = cuda ]; then pip install --no-cache-dir --no-deps -r requirements/kernels.txt; fi
COPY pyproject.toml setup.py README.md LICENSE ./
COPY src/ src/
COPY kernels/ kernels/
COPY services/ services/
# the package alone; its build backend (setuptools) is already installed (a torch dependency)
RUN pip install --no-cache-dir --no-deps --no-build-isolation .

FROM python:3.11.14-slim-bookworm AS runtime
ARG VARIANT
# CUDA only: triton builds its kernel launcher with the system C compiler on first use. libc6-dev
# must match the base image's libc6, so it is not pinned.
# hadolint ignore=DL3008
RUN if [ "$VARIANT" = cuda ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc=4:12.2.0-3 libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 specinfer \
    && useradd --system --uid 10001 --gid specinfer --home-dir /home/specinfer --create-home --shell /usr/sbin/nologin specinfer
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    SPECINFER_HOST=0.0.0.0 \
    SPECINFER_DEVICE=${VARIANT}
WORKDIR /home/specinfer
USER 10001:10001

FROM runtime AS ssm-worker
# 50062: its socket (the request manager's Speculate calls over a plain socket, --socket-port in docs/configuration.md)
ENV SPECINFER_PORT=50052 \
    SPECINFER_SOCKET_PORT=50062
EXPOSE 50052 50062
# health turns SERVING once the models are loaded
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 CMD ["python", "-m", "specinfer.serving.healthcheck"]
ENTRYPOINT ["specinfer-ssm-worker"]

FROM runtime AS llm-verifier
# 50063: its socket (the request manager's Verify calls over a plain socket, --socket-port in docs/configuration.md)
ENV SPECINFER_PORT=50053 \
    SPECINFER_SOCKET_PORT=50063
EXPOSE 50053 50063
# health turns SERVING once the LLM is loaded; a big one takes minutes
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["python", "-m", "specinfer.serving.healthcheck"]
ENTRYPOINT ["specinfer-llm-verifier"]
