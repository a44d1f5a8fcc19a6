#!/usr/bin/env bash
# The HF blog's setup, reproducible: N vLLM replica Jobs + one trainer Job whose sidecar
# process is rollout-gateway; one storage bucket mounted at the SAME path in every Job
# (the trainer writes LoRA checkpoints there, replicas load them by that path); the HF
# token injected into every Job as a secret and used by the gateway as the upstream token.
#
#   export HF_TOKEN=hf_xxx BUCKET=your-org/grpo-run TRAIN_CMD="python train.py"
#   bash deploy/hf-jobs/launch.sh             # DRY_RUN=1 prints the commands instead
#
# Settings (environment): see the defaults below. REPLICA_URL_TEMPLATE turns a replica
# Job's id into the URL under which its port 8000 is reachable from the trainer Job.
# MOUNT_FLAG is how `hf jobs run` mounts the bucket; check `hf jobs run --help` for your
# huggingface_hub version.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

REPLICAS="${REPLICAS:-2}"
MODEL="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"
MAX_STALENESS="${MAX_STALENESS:-4}"
MAX_LORAS="${MAX_LORAS:-$(( MAX_STALENESS + 2 ))}"
VLLM_IMAGE="${VLLM_IMAGE:-vllm/vllm-openai:v0.32.0}"   # the tested release: deploy/versions.env
TRAINER_IMAGE="${TRAINER_IMAGE:-ghcr.io/your-org/trl-trainer:latest}"
REPLICA_FLAVOR="${REPLICA_FLAVOR:-a10g-large}"
TRAINER_FLAVOR="${TRAINER_FLAVOR:-a10g-large}"
TIMEOUT="${TIMEOUT:-12h}"
MOUNT="${MOUNT:-/data}"
BUCKET="${BUCKET:?set BUCKET (namespace/bucket)}"
MOUNT_FLAG="${MOUNT_FLAG:---volume=hf://buckets/${BUCKET}:${MOUNT}}"
REPLICA_URL_TEMPLATE="${REPLICA_URL_TEMPLATE:-}"
[ -n "$REPLICA_URL_TEMPLATE" ] || REPLICA_URL_TEMPLATE='https://{job_id}.jobs.hf.space'

SIDECAR_INSTALL="${SIDECAR_INSTALL:-rollout-gateway}"
TRAIN_CMD="${TRAIN_CMD:?set TRAIN_CMD (TRL reads VLLM_SERVER_BASE_URL)}"
DRY_RUN="${DRY_RUN:-0}"        # 1: print the commands; DRY_RUN_OUT=DIR: also save each
DRY_RUN_OUT="${DRY_RUN_OUT:-}"  # job's arguments NUL-separated in DIR/job-N (for tests)

if (( MAX_LORAS < MAX_STALENESS + 2 )); then
    echo "launch: MAX_LORAS must be >= MAX_STALENESS + 2 (TRL)" >&2
    exit 2
fi

run_job() {  # prints the job id
    if [ "$DRY_RUN" = 1 ]; then
        local n
        n=$(( $(find "${DRY_RUN_OUT:-/nonexistent}" -name 'job-*' 2>/dev/null | wc -l) + 1 ))
        printf '%q ' hf jobs run "$@" >&2
        echo >&2
        if [ -n "$DRY_RUN_OUT" ]; then
            printf '%s\0' "$@" > "$DRY_RUN_OUT/job-$n"
        fi
        echo "dry-run-job-$n"
    else
        hf jobs run --detach "$@" | tail -n 1 | awk '{print $NF}'
    fi
}

urls=()
for i in $(seq 0 $(( REPLICAS - 1 ))); do
    job_id=$(run_job --flavor "$REPLICA_FLAVOR" --timeout "$TIMEOUT" --secrets HF_TOKEN \
        "$MOUNT_FLAG" \
        -e VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 -e VLLM_SERVER_DEV_MODE=1 \
        "$VLLM_IMAGE" \
        vllm serve "$MODEL" --host 0.0.0.0 --port 8000 --enable-lora \
        --max-loras "$MAX_LORAS" --max-cpu-loras "$(( MAX_LORAS + 2 ))" --max-lora-rank 64 \
        --enable-prefix-caching)
    urls+=("${REPLICA_URL_TEMPLATE//"{job_id}"/$job_id}")
    echo "launch: replica $i is job $job_id" >&2
done
replicas=$(IFS=,; echo "${urls[*]}")

trainer=$(run_job --flavor "$TRAINER_FLAVOR" --timeout "$TIMEOUT" --secrets HF_TOKEN \
    "$MOUNT_FLAG" \
    -e "GATEWAY_REPLICAS=$replicas" \
    -e "GATEWAY_MAX_STALENESS=$MAX_STALENESS" \
    -e "GATEWAY_ADAPTER_ROOTS=$MOUNT" \
    -e "SIDECAR_INSTALL=$SIDECAR_INSTALL" \
    -e "ADAPTER_DIR=$MOUNT/adapters" \
    -e "MAX_STALENESS=$MAX_STALENESS" \
    -e "TRAIN_CMD=$TRAIN_CMD" \
    "$TRAINER_IMAGE" \
    bash -c "$(cat "$here/trainer-entry.sh")")
echo "launch: trainer is job $trainer (replicas: $replicas)" >&2
