"""A minimal in-memory model of vLLM's runtime LoRA API, for driving the pure core.

Only what the core's contract needs: 400 on a duplicate name without ``load_inplace``,
404 on unloading an unknown name, and injectable faults. HTTP-level behaviour is covered
by the integration tests over ``rollout_testbed.sim``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.adapters.state import (
    Action,
    AdapterRegistry,
    ListedAdapter,
    LoadOnReplica,
    Outcome,
    Result,
)


@dataclass
class FakeReplica:
    held: dict[str, str] = field(default_factory=dict)
    alive: bool = True
    load_faults: list[Outcome] = field(default_factory=list)
    unload_faults: list[Outcome] = field(default_factory=list)

    def listing(self) -> list[ListedAdapter]:
        return [ListedAdapter(n, p) for n, p in self.held.items()]

    def perform(self, action: Action) -> Result:
        if not self.alive:
            return Result(Outcome.UNREACHABLE)
        if isinstance(action, LoadOnReplica):
            if self.load_faults:
                return _fault(self.load_faults.pop(0))
            if action.name in self.held and not action.inplace:
                return Result(Outcome.REJECTED, 400, "already been loaded")
            self.held[action.name] = action.path
            return Result(Outcome.OK, 200)
        if self.unload_faults:
            return _fault(self.unload_faults.pop(0))
        if self.held.pop(action.name, None) is None:
            return Result(Outcome.NOT_FOUND, 404, "cannot be found")
        return Result(Outcome.OK, 200)


def _fault(outcome: Outcome) -> Result:
    status = {
        Outcome.NOT_FOUND: 404,
        Outcome.REJECTED: 400,
        Outcome.FAILED: 500,
        Outcome.UNREACHABLE: None,
        Outcome.TIMED_OUT: None,
    }[outcome]
    return Result(outcome, status, f"injected {outcome.value}")


def drive(
    core: AdapterRegistry, fakes: list[FakeReplica], actions: list[Action], now: float
) -> float:
    """Perform actions FIFO (honouring ``not_before``) until none are left; return the clock."""
    queue = list(actions)
    while queue:
        action = queue.pop(0)
        if isinstance(action, LoadOnReplica):
            now = max(now, action.not_before)
        if not core.is_current(action):
            continue
        queue += core.on_result(action, fakes[action.replica].perform(action), now)
    return now
