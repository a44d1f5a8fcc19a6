"""The URL under which a replica Job's exposed port is reachable, from the Job's status.

    hf jobs inspect --format json JOB_ID | python3 replica_url.py JOB_ID [PORT]

launch.sh pipes each replica Job's `hf jobs inspect` output here. The Job's status carries
``expose_urls`` (huggingface_hub's ``JobStatus.expose_urls``: one URL per exposed port); this
picks the one for PORT, the same way huggingface_hub's own sandbox picks its server URL (an
https URL whose host starts with ``<job_id>--<port>.``). Only when the status has no URL at
all does it fall back to the pattern huggingface_hub documents for exposed ports,
``https://<job_id>--<port>.hf.jobs``, and it says so on stderr: that pattern is a
documented example, not something this Job reported. A status that lists URLs but none for
PORT is an error (the port was not exposed), not a reason to guess.

Standard library only: it runs under whatever ``python3`` sits next to the ``hf`` CLI.
"""

from __future__ import annotations

import json
import sys
from typing import Any
from urllib.parse import urlparse

DOCUMENTED = "https://{job_id}--{port}.hf.jobs"  # huggingface_hub: HfApi.run_job(expose=...)


def _job_status(inspect_output: str, job_id: str) -> dict[str, Any]:
    """The status of ``job_id`` in ``hf jobs inspect --format json`` output (a JSON list
    of jobs; a single job object, as ``HfApi.inspect_job`` serialises, is accepted too)."""
    text = inspect_output.strip()
    doc = json.loads(text) if text else []
    jobs = doc if isinstance(doc, list) else [doc]
    for job in jobs:
        if isinstance(job, dict) and job.get("id") == job_id:
            status = job.get("status") or {}
            return status if isinstance(status, dict) else {}
    return {}


def replica_url(inspect_output: str, job_id: str, port: int = 8000) -> tuple[str, bool]:
    """(URL, whether it came from the Job's status). Raises ``ValueError`` when the status
    lists exposed URLs but none for ``port``."""
    urls = _job_status(inspect_output, job_id).get("expose_urls") or []
    prefix = f"{job_id}--{port}.".lower()  # urlparse lowercases the host
    for url in urls:
        parsed = urlparse(str(url))
        if parsed.scheme == "https" and (parsed.hostname or "").startswith(prefix):
            return str(url).rstrip("/"), True
    if urls:
        raise ValueError(f"job {job_id} exposes {urls}, none of them port {port}")
    return DOCUMENTED.format(job_id=job_id, port=port), False


def main(argv: list[str]) -> int:
    """Print the URL; exit 2 on bad usage, 1 when the port is not among the exposed ones."""
    if len(argv) not in (2, 3):
        print("usage: replica_url.py JOB_ID [PORT] < inspect.json", file=sys.stderr)
        return 2
    job_id, port = argv[1], int(argv[2]) if len(argv) == 3 else 8000
    try:
        url, reported = replica_url(sys.stdin.read(), job_id, port)
    except ValueError as exc:
        print(f"replica_url: {exc}", file=sys.stderr)
        return 1
    if not reported:
        print(
            f"replica_url: job {job_id}'s status has no expose_urls; using huggingface_hub's "
            f"documented pattern for exposed ports: {url}",
            file=sys.stderr,
        )
    print(url)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
