#!/usr/bin/env bash
# The HF blog's setup, reproducible: N vLLM replica Jobs + one trainer Job whose sidecar
# process is rollout-gateway; one storage bucket mounted at the SAME path in every Job
# (the trainer writes LoRA checkpoints there, replicas load them by that path); the HF
# token injected into every Job as a secret and used by the gateway as the upstream token
# (an exposed Job port only answers requests that carry an HF token). README.md (next to
# this file) lists the settings.
#
#   export BUCKET=your-org/grpo-run TRAINER_IMAGE=ghcr.io/your-org/trl:1.16.0 \
#          TRAIN_CMD="python train.py" \
#          SIDECAR_REPO=https://github.com/your-org/rollout-gateway SIDECAR_REV=<commit>
#   DRY_RUN=1 bash deploy/hf-jobs/launch.sh   # offline: `hf jobs run --dry-run` per Job
#   bash deploy/hf-jobs/launch.sh             # start the Jobs (hf auth login or HF_TOKEN)
#
# Exit status 2: a setting is missing or invalid (nothing was started).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

die() { echo "launch: $*" >&2; exit 2; }

REPLICAS="${REPLICAS:-2}"
MODEL="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"
MAX_STALENESS="${MAX_STALENESS:-4}"
MAX_LORAS="${MAX_LORAS:-$(( MAX_STALENESS + 2 ))}"
MAX_LORA_RANK="${MAX_LORA_RANK:-64}"
VLLM_IMAGE="${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}"   # the tested release: deploy/versions.env
REPLICA_FLAVOR="${REPLICA_FLAVOR:-a10g-large}"
TRAINER_FLAVOR="${TRAINER_FLAVOR:-a10g-large}"
TIMEOUT="${TIMEOUT:-12h}"
MOUNT="${MOUNT:-/data}"
NAMESPACE="${NAMESPACE:-}"      # empty: the token owner's namespace
RUN_NAME="${RUN_NAME:-grpo}"    # Job names: RUN_NAME-replica-N, RUN_NAME-trainer
HF="${HF:-hf}"                  # the huggingface_hub CLI (>= 2.4: --expose, buckets)
PYTHON="${PYTHON:-python3}"     # runs replica_url.py (standard library only)
DRY_RUN="${DRY_RUN:-0}"         # 1: `hf jobs run --dry-run` for every Job, nothing started

# Required, no defaults: a placeholder image or a guessed package would only fail once the
# GPU replicas are already running (and a bare `pip install rollout-gateway` would install
# whatever someone registers under that name on PyPI: it is not published there).
missing=()
for name in BUCKET TRAINER_IMAGE TRAIN_CMD SIDECAR_REPO SIDECAR_REV; do
    [ -n "${!name:-}" ] || missing+=("$name")
done
[ ${#missing[@]} -eq 0 ] || die "missing required setting(s): ${missing[*]} (deploy/hf-jobs/README.md)"

for name in REPLICAS MAX_STALENESS MAX_LORAS MAX_LORA_RANK; do
    [[ "${!name}" =~ ^[0-9]+$ ]] || die "$name must be a non-negative integer, got '${!name}'"
done
(( REPLICAS >= 1 )) || die "REPLICAS must be >= 1"
if (( MAX_LORAS < MAX_STALENESS + 2 )); then
    # Every policy version TRL may still sample from stays loaded (deploy/trl-recipe.md).
    die "MAX_LORAS ($MAX_LORAS) must be >= MAX_STALENESS + 2 ($(( MAX_STALENESS + 2 ))) (TRL)"
fi
[[ "$BUCKET" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$ ]] \
    || die "BUCKET must be namespace/bucket, got '$BUCKET'"
[[ "$MOUNT" =~ ^/[A-Za-z0-9._/-]*$ ]] || die "MOUNT must be an absolute path, got '$MOUNT'"
# The gateway comes from the repository at a pinned revision, never from a package index.
[[ "$SIDECAR_REPO" =~ ^https://[^[:space:]@]+$ ]] \
    || die "SIDECAR_REPO must be the https URL of a rollout-gateway git repository, got '$SIDECAR_REPO'"
[[ "$SIDECAR_REV" =~ ^[A-Za-z0-9][A-Za-z0-9._/-]*$ ]] \
    || die "SIDECAR_REV must be a commit or tag of SIDECAR_REPO, got '$SIDECAR_REV'"
[[ "$RUN_NAME" =~ ^[a-z0-9][a-z0-9-]*$ ]] || die "RUN_NAME must be lowercase letters, digits and dashes"
[ "$DRY_RUN" = 0 ] || [ "$DRY_RUN" = 1 ] || die "DRY_RUN must be 0 or 1"
command -v "$HF" >/dev/null || die "'$HF' not found: pip install 'huggingface_hub>=2.4,<3'"
command -v "$PYTHON" >/dev/null || die "'$PYTHON' not found (set PYTHON)"
SIDECAR_INSTALL="rollout-gateway @ git+${SIDECAR_REPO}@${SIDECAR_REV}"

common=(--timeout "$TIMEOUT" --secrets HF_TOKEN)   # the token's value never enters argv
ns=()
[ -z "$NAMESPACE" ] || ns=(--namespace "$NAMESPACE")

started=()
report_started() {  # on a failure after some Jobs started: name them, they cost money
    local status=$?
    if (( status != 0 && ${#started[@]} > 0 )); then
        echo "launch: failed after starting job(s) ${started[*]}; cancel: $HF jobs cancel <id>" >&2
    fi
}
trap report_started EXIT

n_jobs=0
job_id=""
# Starts one Job and sets job_id. Every argument goes before `--`; the image and the
# command come after it, so hf never reads the command's own flags (`hf jobs run` parses
# options anywhere: a `--timeout` or `-e` meant for vllm would silently become the Job's).
start_job() {
    n_jobs=$(( n_jobs + 1 ))
    if [ "$DRY_RUN" = 1 ]; then
        "$HF" jobs run --dry-run ${ns[@]+"${ns[@]}"} "$@"   # prints the resolved configuration
        job_id="dry-run-job-$n_jobs"
    else
        local out
        out=$("$HF" jobs run --detach --format json ${ns[@]+"${ns[@]}"} "$@")
        job_id=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.stdin.read())["id"])' <<<"$out")
        started+=("$job_id")
    fi
}

# The URL of a replica Job's port 8000: read from the Job's status (expose_urls), the
# documented https://<job_id>--8000.hf.jobs only when the status has none
# (replica_url.py says so on stderr). A dry run has no Job, hence no status.
replica_url() {
    if [ "$DRY_RUN" = 1 ]; then
        echo '[]' | "$PYTHON" "$here/replica_url.py" "$1" 8000
    else
        "$HF" jobs inspect --format json ${ns[@]+"${ns[@]}"} "$1" | "$PYTHON" "$here/replica_url.py" "$1" 8000
    fi
}

urls=()
for i in $(seq 0 $(( REPLICAS - 1 ))); do
    [ "$DRY_RUN" = 0 ] || echo "== replica $i =="
    # --generation-config vllm: vLLM's neutral sampling defaults, not the model card's
    #   generation_config.json (the blog: the card's defaults "collapsed every async run
    #   that inherited them"); TRL sends the sampling parameters it trains with.
    # --logprobs-mode processed_logprobs: logprobs after temperature/top-k/top-p, the
    #   distribution the tokens were sampled from (what TRL's importance ratios need for
    #   temperature != 1; the default raw_logprobs ignores temperature).
    start_job --name "$RUN_NAME-replica-$i" --flavor "$REPLICA_FLAVOR" "${common[@]}" --expose 8000 \
        -v "hf://buckets/$BUCKET:$MOUNT:ro" \
        -e VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 -e VLLM_SERVER_DEV_MODE=1 \
        -- "$VLLM_IMAGE" \
        vllm serve "$MODEL" --host 0.0.0.0 --port 8000 \
        --generation-config vllm --logprobs-mode processed_logprobs \
        --enable-lora --max-loras "$MAX_LORAS" --max-cpu-loras "$(( MAX_LORAS + 2 ))" \
        --max-lora-rank "$MAX_LORA_RANK" --enable-prefix-caching
    url=$(replica_url "$job_id")
    urls+=("$url")
    echo "launch: replica $i is job $job_id at $url" >&2
done
replicas=$(IFS=,; echo "${urls[*]}")

# The trainer Job: trainer-entry.sh is its command. The settings hf would shorten in its
# printed configuration (it cuts env values at 60 characters) are the command's own
# KEY=VALUE arguments instead, so the dry run and the Job's log show them whole.
[ "$DRY_RUN" = 0 ] || echo "== trainer =="
start_job --name "$RUN_NAME-trainer" --flavor "$TRAINER_FLAVOR" "${common[@]}" \
    -v "hf://buckets/$BUCKET:$MOUNT:rw" \
    -e "GATEWAY_MAX_STALENESS=$MAX_STALENESS" \
    -e "GATEWAY_ADAPTER_ROOTS=$MOUNT" \
    -e "ADAPTER_DIR=$MOUNT/adapters" \
    -e "MAX_STALENESS=$MAX_STALENESS" \
    -- "$TRAINER_IMAGE" \
    bash -c "$(cat "$here/trainer-entry.sh")" trainer-entry \
    "GATEWAY_REPLICAS=$replicas" "SIDECAR_INSTALL=$SIDECAR_INSTALL" "TRAIN_CMD=$TRAIN_CMD"
echo "launch: trainer is job $job_id (replicas: $replicas)" >&2
