# syntax=docker/dockerfile:1
# specinfer request manager: the public gRPC API (specinfer.v1.SpecInfer) on port 50051 and the
# OpenAI-compatible HTTP API on port 8000.
#
#   docker build -f docker/request-manager.Dockerfile -t specinfer/request-manager:0.1.0 .
#
# No torch and no transformers: the request manager needs the LLM's tokenizer.json and EOS token
# only (mount the checkpoint folder read-only and set SPECINFER_MODEL_DIR). Every setting is a
# SPECINFER_* environment variable or a flag (docs/configuration.md).

FROM python:3.11.14-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# dependencies first: this layer is rebuilt only when the lock file changes
COPY requirements/request-manager.txt requirements/
RUN pip install --no-cache-dir -r requirements/request-manager.txt \
    && pip check
COPY pyproject.toml setup.py README.md LICENSE ./
COPY src/ src/
COPY kernels/ kernels/
COPY services/ services/
# the package alone, without its torch-side dependencies (so no `pip check` after this); its build
# backend (setuptools) comes from the lock file above
RUN pip install --no-cache-dir --no-deps --no-build-isolation .

FROM python:3.11.14-slim-bookworm
RUN groupadd --system --gid 10001 specinfer \
    && useradd --system --uid 10001 --gid specinfer --home-dir /home/specinfer --create-home --shell /usr/sbin/nologin specinfer
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECINFER_HOST=0.0.0.0 \
    SPECINFER_PORT=50051 \
    SPECINFER_HTTP_PORT=8000 \
    SPECINFER_STATE_DIR=/home/specinfer/state
WORKDIR /home/specinfer
USER 10001:10001
EXPOSE 50051 8000
# the request manager serves once the verifier and the SSM workers answer
HEALTHCHECK --interval=10s --timeout=5s --start-period=90s --retries=3 CMD ["python", "-m", "specinfer.serving.healthcheck"]
ENTRYPOINT ["specinfer-request-manager"]
