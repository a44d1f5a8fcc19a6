"""The HTTP surface: which path is ROUTED, BROADCAST, FAN-IN, FORWARDED or the gateway's own.

=========================================  ==========  ==========================================
path                                       kind        behaviour
=========================================  ==========  ==========================================
/v1/completions, /v1/chat/completions      ROUTED      one replica chosen by the router; body
                                                       forwarded byte for byte; SSE relayed
/v1/load_lora_adapter, /v1/unload_...      BROADCAST   every healthy replica, all or nothing
/pause, /resume, /reset_prefix_cache       BROADCAST   every healthy replica
/health                                    FAN-IN      200 only when every replica is up
/server_info, /v1/models                   FAN-IN      merged: DP=1, weakest lora_config,
                                                       adapters present everywhere
anything else                              FORWARDED   one healthy replica (least loaded);
                                                       a run: its homes, its names only
/livez, /readyz                            GATEWAY     this process's probes: alive; ready to
                                                       take work (``gateway.api.probes``)
/metrics, /gateway/status                  GATEWAY     the gateway's own
/gateway/runs/reload                       GATEWAY     the admin key: reload the run set
=========================================  ==========  ==========================================

Handlers parse a body at most once, ask the router for a decision, let ``upstream`` do the
I/O and report back to the pool and metrics in ``finally``. The modules:

* ``fastpath``   the outer ASGI app and the lean server's handler: every rollout's path
* ``rollout``    one rollout planned and dispatched: a replica, another one on a failure
* ``requests``   reading and checking a request: body size, JSON, headers, parameters
* ``responses``  building responses: JSON, OpenAI-style errors, a replica's answer
* ``auth``       which keys a handler needs, and which run a request belongs to
* ``broadcast``  BROADCAST: the control calls every replica must apply
* ``fanin``      FAN-IN: one answer made from every replica's
* ``forward``    FORWARDED: any other path, to one replica
* ``probes``     ``/livez`` and ``/readyz``
* ``routes``     the route table: which handler serves each path
"""

from gateway.api.fastpath import FastPath
from gateway.api.responses import error_response
from gateway.api.routes import build_routes

__all__ = ["FastPath", "build_routes", "error_response"]
