# rollout-gateway: the sidecar image. Only what `rollout-gateway serve` runs: the gateway
# package without the simulated replica or the local-replica tools, and its locked runtime
# dependencies (deploy/image/requirements.txt: no FastAPI, no torch, no vLLM); no pip, no
# compiler; runs as an unprivileged user; configured through GATEWAY_* variables
# (docs/configuration.md), e.g.
#   docker run -e GATEWAY_REPLICAS=http://vllm-0:8000,http://vllm-1:8000 rollout-gateway
#   docker run -e GATEWAY_DISCOVERY_DNS=vllm-headless:8000 rollout-gateway
# Extra arguments are appended to `rollout-gateway serve` (flags win over GATEWAY_*).
# Built and run as a container by tests/container (scripts/build-image.sh, `make image`);
# linted, and its ENTRYPOINT run outside a container, by tests/deploy/test_dockerfile.py.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a pip-less virtualenv with the locked dependencies and the gateway wheel
FROM ${PYTHON_IMAGE} AS build
# Optional, for this stage only: a package mirror (PIP_INDEX_URL) or the CA bundle of a
# TLS-intercepting proxy (PIP_CERT, with the file mounted into the build). PyPI needs neither.
ARG PIP_INDEX_URL
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Dependencies first: this layer is reused until the Dockerfile or the lock changes.
# /opt/tools holds pip and the build backend, binutils strips the wheels' debug info
# (uvloop's extension alone is 13 MB with it, 1.6 MB without); neither reaches the runtime
# stage. Sources of compiled extensions and type stubs are not run either.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends binutils \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/image/requirements.txt deploy/image/build-requirements.txt ./
RUN python -m venv /opt/tools \
    && /opt/tools/bin/pip install --no-cache-dir --require-hashes --no-deps \
       -r build-requirements.txt \
    && python -m venv --without-pip /opt/gateway \
    && /opt/tools/bin/pip --python /opt/gateway/bin/python install --no-cache-dir \
       --require-hashes --no-deps -r requirements.txt \
    && find /opt/gateway -name '*.so' -exec strip --strip-unneeded {} + \
    && find /opt/gateway/lib \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pyi' -o -name '*.c' \
       -o -name '*.h' \) -delete \
    && rm -f /opt/gateway/bin/activate*
COPY pyproject.toml README.md hatch_build.py ./
COPY gateway ./gateway
# The commit the wheel records (gateway_build_info, --version; hatch_build.py): the build
# context has no .git, so it comes in as an argument (`make image` passes it); "unknown"
# without. Declared here, so a new commit rebuilds only the layers from here on.
ARG GATEWAY_BUILD_COMMIT=unknown
RUN /opt/tools/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
    && /opt/tools/bin/pip --python /opt/gateway/bin/python install --no-cache-dir --no-deps \
       /wheels/*.whl \
    && /opt/gateway/bin/python -I -c "import gateway.cli, gateway.app, uvloop, httptools"

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
# Liveness of the process, not readiness of the fleet: /livez answers whenever the
# gateway's event loop does, while /readyz (and /health) is 503 until every replica is up
# and during a SIGTERM drain, and a sidecar must not be restarted because a replica is down
# (Kubernetes probes: deploy/k8s). It probes the address PID 1 (or its workers) actually
# listens on, read from /proc: the port may come from a flag (container arguments),
# GATEWAY_PORT or the YAML file alike.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-I", "-m", "gateway.http.liveness"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["rollout-gateway", "serve"]
CMD []
