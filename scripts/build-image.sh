#!/usr/bin/env bash
# Build the sidecar image (Dockerfile) with podman as localhost/rollout-gateway:dev.
#
# Where no container registry is reachable (these machines), the Dockerfile's base
# (PYTHON_IMAGE, python:3.11-slim-bookworm by default) is replaced by a local one: Debian
# bookworm (python3 3.11) made by debootstrap from the Debian mirror apt uses, imported
# into podman and tagged by a hash of its recipe, so it is made once per machine.
# Set PYTHON_IMAGE=python:3.11-slim-bookworm to build on the official base instead.
#
# The image is tagged by a hash of everything that goes into it (base, Dockerfile,
# .dockerignore, the locks in deploy/image/, pyproject.toml, README.md, gateway/): an
# unchanged tree costs no build at all. A changed gateway/ rebuilds only the layers after
# the dependency layer, which podman's layer cache keeps until the Dockerfile or the lock
# changes.
#
# Installs podman, runc and debootstrap with apt-get when they are missing (root only).
# Prints the image name on its last line. Env: IMAGE, PYTHON_IMAGE, DEBIAN_MIRROR.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/rollout-gateway:dev}
BASE_REPO=localhost/rollout-gateway-base
# Bump when the base's recipe below changes (the hash covers this line and the mirror).
BASE_RECIPE="bookworm minbase python3,python3-venv,python-is-python3,ca-certificates prune-v1"

BASE_TMP=
trap '[[ -n "$BASE_TMP" ]] && rm -rf "$BASE_TMP"' EXIT

log() { echo "build-image: $*" >&2; }
die() { log "error: $*"; exit 1; }

ensure_tools() {
    local missing=()
    command -v podman >/dev/null 2>&1 || missing+=(podman)
    command -v runc >/dev/null 2>&1 || missing+=(runc)
    # catatonit: the pause process of the pods `podman kube play` makes (tests/container)
    command -v catatonit >/dev/null 2>&1 || [[ -x /usr/libexec/podman/catatonit ]] || missing+=(catatonit)
    if [[ -z "${PYTHON_IMAGE:-}" ]]; then
        command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    fi
    [[ ${#missing[@]} -eq 0 ]] && return 0
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        die "missing ${missing[*]}: install them (Debian/Ubuntu: apt-get install podman runc" \
            "catatonit debootstrap), or run as root on a Debian-based machine"
    fi
    log "installing ${missing[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed: no Debian mirror reachable?"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" uidmap >&2 \
        || die "apt-get install ${missing[*]} failed"
}

# podman flags every command here needs on these machines: runc (crun refuses the hybrid
# cgroup v1 setup) and rlimits no higher than this shell's (``limits``).
# shellcheck source=scripts/podman-limits.sh
source scripts/podman-limits.sh

debian_mirror() {
    if [[ -n "${DEBIAN_MIRROR:-}" ]]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    local uri
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [[ -z "$uri" ]] && uri=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' \
        /etc/apt/sources.list 2>/dev/null || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

# The local stand-in for python:3.11-slim-bookworm; prints its name.
local_base() {
    local mirror hash tag root
    mirror=$(debian_mirror)
    hash=$(printf '%s\n%s\n' "$BASE_RECIPE" "$mirror" | sha256sum | cut -c1-16)
    tag="$BASE_REPO:$hash"
    if podman image exists "$tag"; then
        echo "$tag"
        return
    fi
    log "making the local base $tag (debootstrap from $mirror, about a minute)"
    root=$(mktemp -d /tmp/rollout-gateway-base.XXXXXX)
    BASE_TMP=$root  # removed on exit, whatever happens
    debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        bookworm "$root/rootfs" "$mirror" >"$root/debootstrap.log" 2>&1 \
        || { tail -20 "$root/debootstrap.log" >&2; die "debootstrap from $mirror failed"; }
    # What a slim image also leaves out: package caches and lists, docs, man pages, locales.
    rm -rf "$root"/rootfs/var/cache/apt/* "$root"/rootfs/var/lib/apt/lists/* \
        "$root"/rootfs/usr/share/doc/* "$root"/rootfs/usr/share/man/* \
        "$root"/rootfs/usr/share/locale/* "$root"/rootfs/var/log/*
    tar -C "$root/rootfs" -c . | podman import --quiet \
        --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' - "$tag" >/dev/null
    rm -rf "$root"
    echo "$tag"
}

# Every input of the image, hashed: the tag that says "already built".
context_hash() {
    local base_id=$1
    {
        echo "$base_id"
        sha256sum Dockerfile .dockerignore pyproject.toml README.md hatch_build.py \
            deploy/image/*.txt
        find gateway -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
            | sort -z | xargs -0 sha256sum
    } | sha256sum | cut -c1-16
}

main() {
    ensure_tools
    local base base_id hash tag ca args=()
    if [[ -n "${PYTHON_IMAGE:-}" ]]; then
        base=$PYTHON_IMAGE
        podman image exists "$base" || podman pull "$base" >&2 || die "cannot pull $base"
    else
        base=$(local_base)
    fi
    base_id=$(podman image inspect --format '{{.Id}}' "$base")
    hash=$(context_hash "$base_id")
    tag="${IMAGE%:*}:ctx-$hash"
    if podman image exists "$tag"; then
        log "up to date: $tag"
    else
        log "building $tag from $base"
        # The host's CA bundle, for pip in the build stage (a TLS-intercepting proxy's CA).
        ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
        if [[ -f "$ca" ]]; then
            args+=(--volume "$ca:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
        fi
        args+=(--build-arg "PIP_INDEX_URL=${PIP_INDEX_URL:-https://pypi.org/simple}")
        # The commit gateway_build_info reports: the one this image was built from. It is
        # not in the tag's hash: a later commit with the same inputs reuses this image,
        # whose code is that commit's too.
        args+=(--build-arg "GATEWAY_BUILD_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null \
            || echo unknown)")
        # --format docker keeps HEALTHCHECK (OCI image configs have no such field);
        # --network=host: the build stage reaches the package registry.
        # shellcheck disable=SC2046
        podman build --runtime runc --format docker --layers --network=host \
            $(limits) --build-arg "PYTHON_IMAGE=$base" "${args[@]}" \
            --tag "$tag" --file Dockerfile . >&2 || die "podman build failed"
    fi
    podman tag "$tag" "$IMAGE"
    # One ctx- image per repository: older ones are superseded (the layer cache stays).
    podman images --format '{{.Repository}}:{{.Tag}}' "${IMAGE%:*}" | grep ':ctx-' \
        | grep -vxF "$tag" | xargs -r podman rmi >/dev/null 2>&1 || true
    echo "$IMAGE"
}

main "$@"
