"""What the supervisor's parts share about one job: its spec and sizes, and the live run's state.

One `JobRun` per supervisor instance. The actor's inbox (`report`, from worker threads) writes the
worker notes here under `lock`; the controller's thread reads them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.state_machine import StateMachine
from workers.protocol import FaultNote, Formed, Note


class JobFailed(RuntimeError):
    """The job fails with this reason (no recovery)."""


class CancelRequested(Exception):
    """The user cancelled the job."""


@dataclass
class JobRun:
    job_id: str
    spec: Any  # service.spec.JobSpec
    namespace: str
    store: Any  # service.store.JobStore, or None without a store
    restarted: bool  # this instance is a restart of a supervisor that crashed
    self_handle: Any  # this actor's handle (workers report to it)
    mp: int  # workers per replica (tp x pp x cp)
    cp_tp: int
    per_worker: dict[str, float]
    dp_min: int
    dp_max: int
    output_dir: Path
    sm: StateMachine = field(default_factory=StateMachine)
    lock: threading.RLock = field(default_factory=threading.RLock)
    cancel: threading.Event = field(default_factory=threading.Event)
    shutdown: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    generation: int = -1
    dp: int = 0
    recoveries: int = 0
    reason: str | None = None
    # Worker notes (written by the inbox under `lock`):
    hb: dict[str, tuple[float, Note]] = field(default_factory=dict)  # name -> (seen, its last note)
    formed: dict[str, Formed] = field(default_factory=dict)  # this generation's `formed` notes
    # worker -> (pid, id of its model) in the last generation: who trains on in the same objects next
    models_before: dict[str, tuple[int, int]] = field(default_factory=dict)
    faults: list[FaultNote] = field(default_factory=list)  # chaos notes
    step_reports: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)  # step -> gaps, times
    pending_rows: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank 0's metrics rows, unwritten
    last_step_seen: int = 0

    @property
    def ft(self) -> Any:
        return self.spec.fault_tolerance

    def check_cancel(self) -> None:
        if self.cancel.is_set():
            raise CancelRequested()

    def heartbeats(self) -> dict[str, tuple[float, Note]]:
        with self.lock:
            return dict(self.hb)
