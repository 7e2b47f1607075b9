"""The scale simulation's settings, clock and measures (tests/benchmarks/scale_sim.py runs it).

A SIMULATION's parts: what it is set up with (Params), the virtual clock the supervisor's inbox reads
meanwhile, and the size of an object graph (the supervisor's state in memory).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.05  # the supervisor's watch loop (generations._POLL_S)
RAY_DEATH_S = 0.05  # Ray reports an actor's death (NOTES.md: kill 0.01 s, SIGKILL 0.05 s)
RAY_NODE_S = 1.4  # and a node's, with the health-check settings of NOTES.md
KINDS = ("death", "node_loss", "hang", "straggler")


@dataclass
class Params:
    ranks: int
    mode: str = "agents"  # or "flat"
    per_node: int = 8
    step_s: float = 1.0
    snapshot_s: float = 0.3  # a snapshot's ack comes this long after its step
    heartbeat_interval_s: float = 1.0  # the ranks' side-thread heartbeat (spec default)
    heartbeat_timeout_s: float = 3.0
    agent_interval_s: float = 0.25
    agent_misses: int = 3
    net_s: float = 0.001  # one message's latency
    recv_cpu_s: float = 0.0  # Ray's CPU in a receiver per call (measured by scale_bench), added to each message
    recv_cpu_per_rank_s: float = 0.0  # and per rank a batch carries (a bigger message costs more to unpack)
    fanin: int = 16  # nodes per agent group (workers.node_agent.FANIN; 1: every agent sends to the supervisor)
    trials: dict[str, int] = field(default_factory=lambda: {"death": 10, "node_loss": 10, "hang": 4, "straggler": 3})
    gap_s: float = 1.5  # quiet time between a decision and the next fault
    send_on_acks: bool = True  # agents send a batch at once when a snapshot's acks are all in (else at the interval)
    seed: int = 0


class _VirtualClock:
    """The simulation's clock, in place of the `time` module where the supervisor's inbox reads it."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def deep_size(obj: Any) -> int:
    """Bytes of an object graph (containers, dataclasses), each object once."""
    seen: set[int] = set()
    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, type):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not callable(o):
            stack.extend(vars(o).values())
    return total
