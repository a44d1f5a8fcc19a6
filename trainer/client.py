"""Control-plane calls to "the vLLM server" (the gateway, or one replica), TRL's way.

TRL 1.16 makes these calls with ``requests`` (so the server sees a ``python-requests``
user agent) and treats the answers exactly as below; keeping the same client and the same
status handling means the gateway sees from this driver what it will see from TRL:

* ``GET /health`` polled every 2 s with a 5 s timeout until 200;
* ``GET /server_info?config_format=json`` -> ``vllm_config``;
* ``POST /pause?mode=keep`` and ``POST /resume`` with no body, non-200 is fatal;
* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace": false}``:
  404 means the server lacks ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, other non-200 is fatal;
* ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: status ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import requests

__all__ = ["ControlClient", "ServerError"]


class ServerError(RuntimeError):
    """The vLLM server (or gateway) answered a control call with a fatal status."""


class ControlClient:
    def __init__(self, base_url: str, server_timeout: float = 240.0, timeout: float = 1800.0):
        self.base_url = base_url.rstrip("/")
        self.server_timeout = server_timeout
        self.timeout = timeout
        self._session = requests.Session()
        # Called with {"t", "method", "path", "query", "body", "status"} after each
        # state-changing call: the driver's own record of the sync sequence it sent.
        self.on_call: Callable[[dict[str, Any]], None] | None = None

    def _record(self, path: str, query: str, body: Any, status: int) -> None:
        if self.on_call is not None:
            self.on_call({"t": time.time(), "method": "POST", "path": path, "query": query,
                          "body": body, "status": status})  # fmt: skip

    def close(self) -> None:
        self._session.close()

    def wait_for_server_ready(self, poll_interval_s: float = 2.0) -> float:
        """Block until ``/health`` answers 200; returns the seconds waited."""
        start = time.monotonic()
        while True:
            try:
                if self._session.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except (requests.ConnectionError, requests.Timeout, OSError):
                pass
            if time.monotonic() - start >= self.server_timeout:
                raise TimeoutError(
                    f"no 200 from {self.base_url}/health within {self.server_timeout:.0f} s"
                )
            time.sleep(poll_interval_s)

    def server_info(self) -> dict[str, Any]:
        r = self._session.get(
            f"{self.base_url}/server_info", params={"config_format": "json"}, timeout=30
        )
        r.raise_for_status()
        info: dict[str, Any] = r.json()["vllm_config"]
        return info

    def models(self) -> list[dict[str, Any]]:
        r = self._session.get(f"{self.base_url}/v1/models", timeout=30)
        r.raise_for_status()
        data: list[dict[str, Any]] = r.json()["data"]
        return data

    def max_model_len(self) -> int:
        return int(self.models()[0]["max_model_len"])

    def pause(self) -> None:
        r = self._session.post(
            f"{self.base_url}/pause", params={"mode": "keep"}, timeout=self.timeout
        )
        self._record("/pause", "mode=keep", None, r.status_code)
        if r.status_code != 200:
            raise ServerError(f"/pause failed: {r.status_code} {r.text[:300]}")

    def resume(self) -> None:
        r = self._session.post(f"{self.base_url}/resume", timeout=self.timeout)
        self._record("/resume", "", None, r.status_code)
        if r.status_code != 200:
            raise ServerError(f"/resume failed: {r.status_code} {r.text[:300]}")

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        body = {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": False}
        r = self._session.post(
            f"{self.base_url}/v1/load_lora_adapter", json=body, timeout=self.timeout
        )
        self._record("/v1/load_lora_adapter", "", body, r.status_code)
        if r.status_code == 404:
            raise ServerError(
                f"{self.base_url} has no /v1/load_lora_adapter (404: {r.text[:200]}); restart "
                "vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
            )
        if r.status_code != 200:
            raise ServerError(f"load of {lora_name} failed: {r.status_code} {r.text[:300]}")

    def unload_lora_adapter(self, lora_name: str) -> int:
        """Status is ignored by TRL (an unknown name is not an error); returned for logs."""
        r = self._session.post(
            f"{self.base_url}/v1/unload_lora_adapter",
            json={"lora_name": lora_name},
            timeout=self.timeout,
        )
        self._record("/v1/unload_lora_adapter", "", {"lora_name": lora_name}, r.status_code)
        return r.status_code

    def metrics_text(self) -> str | None:
        """The server's Prometheus text (the gateway's ``gateway_*`` or vLLM's ``vllm:*``)."""
        try:
            r = self._session.get(f"{self.base_url}/metrics", timeout=10)
        except (requests.RequestException, OSError):
            return None
        return r.text if r.status_code == 200 else None
