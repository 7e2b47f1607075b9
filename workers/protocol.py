"""What a worker and its supervisor say to each other: small typed messages, the same on both sides.

Worker -> supervisor, fire and forget (`supervisor.report.remote(note)`):
    Heartbeat          every step (with the step's timings; rank 0's with its metrics row) and from a
                       side thread at least every heartbeat_interval_s; it carries the rank's snapshot
                       acks since its last note (one Ray call a step for both)
    Formed             the rank joined its generation's group and restored
    SnapshotAck        its in-memory snapshot of a step is (or is not) held by the keepers: inside a
                       Heartbeat, or on its own when the snapshot failed (at once)
    CheckpointReport   rank 0: a persistent checkpoint was written (or failed, or was abandoned)
    FaultNote          a chaos fault is about to act on this worker
Node agent -> its group's leader agent -> supervisor (workers.node_agent; one per group per interval,
at once when a rank or a member node is lost):
    NodeBatch          its ranks' heartbeats, step timings and snapshot acks folded into one message,
                       the ranks it saw lost (RankLost), and the rare notes relayed as they are
Worker -> supervisor, as the return value of `run`:
    RunResult          how the rank's part of a generation ended (RunStatus)
Supervisor -> worker, after the supervisor restarted (notes sent while it was down are lost):
    rows_after(step)   the metrics rows of the steps after `step` the worker completed, each as
                       (generation, rank, row): every rank keeps its newest rows for this

Every note carries the worker's name, generation, rank and the time it was sent, and the output
lines the worker printed since its last note (`logs`: (time, stream, line)), so the job's logs
travel with the heartbeats. Plain dataclasses: they pickle through Ray and import nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

LogLine = tuple[float, str, str]  # (time, stream, line)


class RunStatus(StrEnum):
    FINISHED = "finished"  # trained to the last step (rank 0 wrote the final state)
    PAUSED = "paused"      # stopped after the step the supervisor asked for (to grow)
    ABORTED = "aborted"    # stopped by the supervisor (its generation ended)
    ERROR = "error"        # an exception: see `error`, `collective`
    DEAD = "dead"          # (supervisor side) the actor died


@dataclass
class Note:
    worker: str
    generation: int
    rank: int
    time: float
    logs: list[LogLine] = field(default_factory=list, kw_only=True)

    @property
    def source(self) -> str:
        """Who printed the note's output lines: `rank <r>` once ranked, else the worker's own name."""
        return f"rank {self.rank}" if self.rank >= 0 else self.worker.rsplit("/", 1)[-1]


@dataclass
class StepReport:
    """One training step of one rank."""

    step: int
    gap_s: float  # its own time before entering the step (data, delays): what a straggler shows
    step_time_s: float
    loss: float


@dataclass
class Heartbeat(Note):
    phase: str
    step: int
    pid: int
    last: StepReport | None = None  # the rank's last step in this generation
    metrics: dict[str, Any] | None = None  # rank 0, right after a step: its metrics row
    acks: list[SnapshotAck] = field(default_factory=list)  # its snapshots held since its last note
    uploading: int | None = None  # the step of its persistent save in flight, if any


@dataclass
class Formed(Note):
    step: int
    restored: dict[str, Any]  # step, source, fallback_reason, ...
    timings: dict[str, float]  # join_s, build_s, restore_s


@dataclass
class SnapshotAck(Note):
    step: int
    ok: bool
    world_size: int
    errors: dict[str, str] = field(default_factory=dict)  # node -> why its copy failed
    acked: list[str] = field(default_factory=list)  # nodes whose keeper holds the shard


@dataclass
class CheckpointReport(Note):
    step: int
    ok: bool
    uri: str | None
    error: str | None
    abandoned: bool  # its group broke under it: a failure, reported as such, not a storage problem
    tier: str = "persistent"


@dataclass
class FaultNote(Note):
    kind: str  # the chaos fault's kind
    step: int
    at: str = "step"  # where it fired (workers.chaos.Fault.at): before step `step`, or as its group connected


@dataclass
class RunResult:
    status: RunStatus
    worker: str
    generation: int
    rank: int
    step: int
    error: str | None = None
    collective: bool = False  # the error is a broken collective (a peer's failure), not this rank's own
    traceback: str | None = None
    time: float | None = None
    final: str | None = None  # where rank 0 wrote the final state

    @property
    def ok(self) -> bool:
        return self.status in (RunStatus.FINISHED, RunStatus.PAUSED)


@dataclass
class RankLost:
    """A rank its node agent saw go: its process exited (`died`), was stopped (`stopped`: SIGSTOP or a
    tracer, so it makes no progress: a hang seen without waiting for heartbeat_timeout_s) or fell silent
    (`hang`)."""

    worker: str
    rank: int
    generation: int
    kind: str  # "died" | "stopped" | "hang"
    detail: str
    t_fault: float | None  # its last heartbeat (hang, stopped) or the agent's last look that found it alive (died)
    t_seen: float


@dataclass
class NodeBatch(Note):
    """One node's ranks in one message (worker: the agent's name; rank: -1). The supervisor's work per
    interval is then one message per node, whatever the ranks per node.

    `steps`: step -> worker -> (gap_s, step_time_s) of the steps its ranks completed since the last
    batch (what the straggler policy needs); `acks`: (generation, step) -> ranks whose snapshot shard
    the keepers hold, `ack_world` their world size, `ack_held` the nodes holding each rank's copies (the
    supervisor commits on them without asking the keepers), `ack_failures` ranks whose snapshot failed;
    `beats`: worker -> when the agent last heard from it (the heartbeat-age gauge); `notes`: Formed,
    CheckpointReport, FaultNote, failed acks and rank 0's metrics heartbeat, relayed unchanged (rare);
    `rank_logs`: the ranks' output lines with their source (`rank <r>`).
    """

    node: str
    seq: int
    max_step: int = 0
    max_step_time_s: float = 0.0
    steps: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    acks: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    ack_world: dict[tuple[int, int], int] = field(default_factory=dict)
    ack_held: dict[tuple[int, int], dict[int, list[str]]] = field(default_factory=dict)
    ack_failures: int = 0
    beats: dict[str, float] = field(default_factory=dict)
    lost: list[RankLost] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    rank_logs: list[tuple[float, str, str]] = field(default_factory=list)  # (time, source, line)
    # A group leader's batch carries its members' (workers.node_agent: a tree of agents, so the
    # supervisor gets one message per group): when it last heard from each member's agent, and the
    # members it found silent (node -> last heard): those nodes are lost.
    members: dict[str, float] = field(default_factory=dict)
    lost_nodes: dict[str, float] = field(default_factory=dict)
    # How many live ranks of `generation` the sending agent answers for (a leader: with its members'): an
    # agent sends at once when a snapshot's acks from all of them are in (the commit waits on no interval).
    ranks: int = 0
