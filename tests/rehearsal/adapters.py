"""The adapter folder of a rehearsal: an absolute host path holding one of the tiny model's
adapters, copied out of the vLLM CPU image (so it matches the model that image serves)."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

from tests.container._podman import podman

ADAPTER = "trl-policy-v1"


def adapter_dir(vllm_image: str) -> Path:
    """A fresh absolute folder (mode 0755, readable by the containers' uid 10001) holding
    ``ADAPTER``; the caller removes it."""
    root = Path(tempfile.mkdtemp(prefix="rgw-rehearsal-adapters-"))
    root.chmod(0o755)
    name = f"rgw-rehearsal-cp-{uuid.uuid4().hex[:8]}"
    podman("create", "--name", name, vllm_image)
    try:
        podman("cp", f"{name}:/models/tiny/adapters/{ADAPTER}", str(root / ADAPTER))
    finally:
        podman("rm", "--force", name, check=False)
    for path in (root, *root.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root
