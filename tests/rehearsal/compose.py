"""One podman-compose project of the rehearsal: deploy/compose/compose.yaml plus the CPU
overlay, nothing else but a test-only env file (images, model, ADAPTER_DIR, host ports).

The project gets a unique name, so its containers (``<project>_<service>_1``), network
(``<project>_default``) and volume (``<project>_hf-cache``) are this test's alone; ``down``
removes them, and ``leftovers`` names any that are still there, asked by name.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.container._podman import REPO, RUN_FLAGS, podman

COMPOSE_DIR = REPO / "deploy" / "compose"
FILES = ("compose.yaml", "compose.cpu.yaml")
# Grafana is left out: its image cannot be pulled or built here (compose.cpu.yaml says so).
SERVICES = ("vllm-0", "vllm-1", "gateway", "prometheus")
PODMAN_COMPOSE = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "podman-compose"


def containers_conf(path: Path) -> Path:
    """podman-compose passes no --runtime/--ulimit: the flags every podman command here
    needs (tests/container/_podman.RUN_FLAGS) as a containers.conf."""
    limits = dict(f.split("=", 1) for f in RUN_FLAGS if "=" in f and ":" in f)
    ulimits = f'default_ulimits = ["nofile={limits["nofile"]}", "nproc={limits["nproc"]}"]'
    path.write_text(f'[containers]\n{ulimits}\n[engine]\nruntime = "runc"\n')
    return path


@dataclass
class Project:
    env: dict[str, str]  # the test-only env file's contents
    workdir: Path
    name: str = field(default_factory=lambda: f"rgw-rehearsal-{uuid.uuid4().hex[:8]}")

    @property
    def containers(self) -> list[str]:
        return [f"{self.name}_{svc}_1" for svc in SERVICES]

    @property
    def network(self) -> str:
        return f"{self.name}_default"

    @property
    def volume(self) -> str:
        return f"{self.name}_hf-cache"

    def compose(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env_file = self.workdir / "rehearsal.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))
        conf = containers_conf(self.workdir / "containers.conf")
        files = [a for f in FILES for a in ("-f", str(COMPOSE_DIR / f))]
        argv = [str(PODMAN_COMPOSE), "-p", self.name, *files, "--env-file", str(env_file)]
        return subprocess.run(
            [*argv, *args], cwd=COMPOSE_DIR, capture_output=True, text=True, timeout=timeout,
            check=False, env={**os.environ, "CONTAINERS_CONF": str(conf)},
        )  # fmt: skip

    def up(self) -> None:
        res = self.compose("up", "-d", "--no-build", *SERVICES)
        assert res.returncode == 0, res.stdout + res.stderr

    def down(self) -> str:
        res = self.compose("down", "-v", "-t", "10")
        return res.stdout + res.stderr

    def leftovers(self) -> list[str]:
        """What of this project still exists, asked by name."""
        left = [c for c in self.containers if self._exists("container", c)]
        for kind, name in (("network", self.network), ("volume", self.volume),
                           ("pod", f"pod_{self.name}")):  # fmt: skip
            if self._exists(kind, name):
                left.append(f"{kind} {name}")
        return left

    @staticmethod
    def _exists(kind: str, name: str) -> bool:
        return podman(kind, "exists", name, check=False).returncode == 0

    def force_remove(self) -> None:
        """Last resort after a failed ``down``: remove each of this project's things by name."""
        for name in self.containers:
            podman("rm", "--force", "--time", "5", name, check=False, timeout=60)
        podman("pod", "rm", "--force", f"pod_{self.name}", check=False)
        podman("network", "rm", "--force", self.network, check=False)
        podman("volume", "rm", "--force", self.volume, check=False)

    def logs(self, service: str) -> str:
        res = podman("logs", f"{self.name}_{service}_1", check=False)
        return res.stdout + res.stderr
