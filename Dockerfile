# rollout-gateway: the sidecar image. Only the gateway's own dependencies (no torch, no
# vLLM); runs as an unprivileged user; configured entirely through GATEWAY_* variables
# (docs/configuration.md), e.g.
#   docker run -e GATEWAY_REPLICAS=http://vllm-0:8000,http://vllm-1:8000 rollout-gateway
#   docker run -e GATEWAY_DISCOVERY_DNS=vllm-headless:8000 rollout-gateway
# Extra arguments are appended to `rollout-gateway serve` (flags win over GATEWAY_*).
# Checked by tests/deploy/test_dockerfile.py (hadolint, and the ENTRYPOINT + CMD run
# outside a container against a simulated replica).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a self-contained virtualenv with the package and its runtime deps only
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN python -m venv /opt/gateway \
    && /opt/gateway/bin/pip install --no-cache-dir . \
    && /opt/gateway/bin/python -c "import gateway.app, uvloop, httptools"

# ---- runtime
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="rollout-gateway" \
      org.opencontainers.image.description="One vLLM URL in front of N vLLM replicas for async LoRA GRPO" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin gateway
COPY --from=build /opt/gateway /opt/gateway
ENV PATH=/opt/gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8000 \
    GATEWAY_LOG_FORMAT=json
USER 10001:10001
EXPOSE 8000
# Healthy = ready to serve: /health is 200 once every replica (or health_min_replicas)
# is up. Orchestrators with their own probes (Kubernetes) ignore this; see deploy/k8s.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GATEWAY_PORT', '8000') + '/health', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["rollout-gateway", "serve"]
CMD []
