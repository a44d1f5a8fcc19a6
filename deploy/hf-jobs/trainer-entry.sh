#!/usr/bin/env bash
# Trainer Job entry point: rollout-gateway as a sidecar *process* next to the trainer.
# launch.sh sends this script as the trainer Job's command; it also runs as is on any
# machine (tests/deploy/test_manifests.py runs it against a simulated replica).
#   GATEWAY_REPLICAS   comma-separated replica URLs (launch.sh: the Jobs' exposed port 8000)
#   HF_TOKEN           injected by the Job (--secrets HF_TOKEN); becomes the upstream token
#   TRAIN_CMD          the training command; TRL must use vllm_server_base_url=$VLLM_SERVER_BASE_URL
#   SIDECAR_INSTALL    optional pip requirement that installs the gateway first: a git URL at
#                      a pinned revision or a wheel path, never a bare name (launch.sh:
#                      "rollout-gateway @ git+https://...@REV"; needs git in the image)
# Each may also come as a KEY=VALUE argument (launch.sh passes them so, because `hf jobs`
# shortens environment values to 60 characters in the configuration it prints).
set -euo pipefail
for setting in "$@"; do
    case "${setting%%=*}" in
        GATEWAY_REPLICAS|SIDECAR_INSTALL|TRAIN_CMD) export "${setting?}" ;;
        *) echo "trainer-entry: unknown argument '${setting%%=*}'" >&2; exit 2 ;;
    esac
done
: "${GATEWAY_REPLICAS:?set GATEWAY_REPLICAS}" "${TRAIN_CMD:?set TRAIN_CMD}"
if [ -n "${SIDECAR_INSTALL:-}" ]; then
    case "$SIDECAR_INSTALL" in
        *://*|/*|./*) ;;
        *)  # a bare name resolves on PyPI, where rollout-gateway is not published
            echo "trainer-entry: SIDECAR_INSTALL must be a URL or a path, got '$SIDECAR_INSTALL'" >&2
            exit 2 ;;
    esac
    python -m pip install -q "$SIDECAR_INSTALL"
fi
export GATEWAY_HOST=127.0.0.1
export GATEWAY_PORT="${GATEWAY_PORT:-8000}"
export GATEWAY_LOG_FORMAT="${GATEWAY_LOG_FORMAT:-json}"
if [ -n "${HF_TOKEN:-}" ]; then
    export GATEWAY_UPSTREAM_TOKEN="$HF_TOKEN"   # the replicas' HF_TOKEN-protected endpoints
fi
export VLLM_SERVER_BASE_URL="http://127.0.0.1:${GATEWAY_PORT}"

rollout-gateway serve &
gateway_pid=$!
# shellcheck disable=SC2329  # invoked by the EXIT trap
stop_gateway() {
    if kill -0 "$gateway_pid" 2>/dev/null; then
        kill -TERM "$gateway_pid"          # drains in-flight requests, exits 0
        wait "$gateway_pid" || true
    fi
}
trap stop_gateway EXIT

# Wait until every replica is up (vLLM cold start can take many minutes).
deadline=$(( $(date +%s) + ${SIDECAR_WAIT_S:-1800} ))
until python -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "$VLLM_SERVER_BASE_URL/health" 2>/dev/null; do
    if ! kill -0 "$gateway_pid" 2>/dev/null; then
        echo "trainer-entry: rollout-gateway exited" >&2
        exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "trainer-entry: replicas not healthy in time" >&2
        exit 1
    fi
    sleep 2
done

status=0
bash -c "$TRAIN_CMD" || status=$?
exit "$status"
