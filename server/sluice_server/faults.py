"""Faults injected on purpose, for the fault tests (integration-tests/test_abuse.py).

Read once at startup from `SLUICE_FAULT`; unset (always, in production)
means no fault and no cost beyond one comparison per step. The launcher
passes its environment to every shard, so a test sets the variable on the
launcher and names the rank that fails:

    SLUICE_FAULT=shard-step-error:RANK:N   rank RANK raises inside its N-th
                                           Step that runs the model (1-based),
                                           after validation and before the
                                           forward pass, so the other ranks
                                           wait in a collective.

Values starting with `router-` are the router's (it reads the same variable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "SLUICE_FAULT"


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


@dataclass
class Faults:
    fail_at_step: int = 0  # 0: never
    steps: int = 0

    def before_forward(self) -> None:
        self.steps += 1
        if self.fail_at_step and self.steps == self.fail_at_step:
            raise InjectedFault(f"{ENV}: injected failure at step {self.steps}")


def from_env(rank: int, environ=os.environ) -> Faults:
    """This rank's faults; a malformed value fails the start loudly."""
    raw = environ.get(ENV, "").strip()
    if not raw or raw.startswith("router-"):
        return Faults()
    kind, _, rest = raw.partition(":")
    parts = rest.split(":")
    if kind != "shard-step-error" or len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[1]) < 1:
        raise ValueError(f"{ENV}={raw!r}: expected shard-step-error:RANK:N (N >= 1)")
    fault_rank, n = int(parts[0]), int(parts[1])
    return Faults(fail_at_step=n if fault_rank == rank else 0)
