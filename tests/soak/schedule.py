"""The soak's fault schedule: seeded, random, covering every kind at least once.

Faults inside the job go into its spec's `chaos` list (workers/chaos.py), each with `generation: null`
so it fires once, in whichever generation first reaches its rank and step. Faults of the service's own
parts are the driver's (tests/soak/services.py), fired when the job's progress reaches their step:

    kill_s3            SIGKILL the S3 server (SeaweedFS), start it again on its data a few seconds later
    restart_store      stop the job store (PostgreSQL) and start it again a few seconds later
    kill_api           SIGKILL `unbroken serve`, start it again on the same store and port
    kill_supervisor@recovery, sigkill_worker@recovery
                       once the job's previous fault is detected, SIGKILL its supervisor's (a worker's)
                       process in the middle of that recovery

A fault "during a save" is one at a step that is a multiple of `persist_every`: it fires while that
step's persistent checkpoint is being written in the background.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

JOB_KINDS = ("kill_worker", "sigkill_worker", "hang_worker", "kill_node", "slow_worker", "raise_in_step",
             "kill_keeper", "kill_supervisor")
SERVICE_KINDS = ("kill_s3", "restart_store", "kill_api")
RECOVERY_KINDS = ("kill_supervisor@recovery", "sigkill_worker@recovery")
ALL_KINDS = JOB_KINDS + SERVICE_KINDS + RECOVERY_KINDS
# Cheap faults fill the schedule beyond one of each; hangs and node losses are slow to detect or heal.
FILLERS = ("kill_worker", "sigkill_worker", "raise_in_step", "kill_supervisor", "kill_api", "restart_store",
           "kill_s3", "kill_worker@save")


@dataclass(frozen=True)
class Fault:
    kind: str  # one of ALL_KINDS
    step: int  # fires once the job has completed this step
    rank: int = 0  # in-job faults: the rank it fires on
    during_save: bool = False  # its step is a persistent checkpoint's

    @property
    def in_job(self) -> bool:
        return self.kind in JOB_KINDS

    @property
    def label(self) -> str:
        return self.kind + (" (during a save)" if self.during_save else "")

    def chaos(self) -> dict[str, Any]:
        """The job spec's chaos event for an in-job fault."""
        ev: dict[str, Any] = {"kind": self.kind, "step": self.step, "rank": self.rank, "generation": None}
        if self.kind == "slow_worker":
            ev["seconds"] = 2.0  # several times a step: replaced as a straggler
        return ev


# In-job faults whose recovery the driver can interrupt (their failure is detected within a second).
RECOVERABLE = ("kill_worker", "sigkill_worker", "raise_in_step")


def make_schedule(seed: int, *, steps: int, faults: int, persist_every: int, ranks: int = 2,
                  min_gap: int = 8) -> list[Fault]:
    """`faults` faults: every kind at least once when `faults` allows it (else a seeded mix with one
    fault inside a recovery and one during a save), at steps at least `min_gap` apart in
    [min_gap, steps - min_gap]. A fault inside a recovery shares the step of the fault it interrupts."""
    rng = random.Random(seed)
    n_recovery = len(RECOVERY_KINDS) if faults >= len(ALL_KINDS) + 1 else 1
    if faults >= len(ALL_KINDS) + 1:
        base = [k for k in ALL_KINDS if k not in RECOVERY_KINDS] + ["kill_worker@save"]
        base += [rng.choice(FILLERS) for _ in range(faults - n_recovery - len(base))]
        recovery = list(RECOVERY_KINDS)
    else:
        base = ["kill_worker", "kill_worker@save"]
        base += rng.sample([k for k in JOB_KINDS + SERVICE_KINDS if k not in base], faults - 1 - len(base))
        recovery = [rng.choice(RECOVERY_KINDS)]
    rng.shuffle(base)
    room = steps - 2 * min_gap
    if room < len(base) * min_gap:
        raise ValueError(f"{len(base)} faults do not fit {min_gap} steps apart in {steps} steps")
    slack = room - len(base) * min_gap
    cuts = sorted(rng.randint(0, slack) for _ in base)
    out: list[Fault] = []
    for i, (kind, c) in enumerate(zip(base, cuts, strict=True)):
        step = min_gap + i * min_gap + c
        if kind.endswith("@save"):  # the nearest checkpoint step, unless another fault has it
            at = max(persist_every, round(step / persist_every) * persist_every)
            step = at if all(f.step != at for f in out) and at < steps - 1 else step
            kind = kind.removesuffix("@save")
        out.append(Fault(kind, step, rng.randrange(ranks), during_save=step % persist_every == 0))
    hosts = [f for f in out if f.kind in RECOVERABLE and not f.during_save]
    if len(hosts) < len(recovery):
        raise ValueError(f"seed {seed}: only {len(hosts)} worker faults to interrupt the recovery of")
    for kind, host in zip(recovery, rng.sample(hosts, len(recovery)), strict=True):
        out.append(Fault(kind, host.step, host.rank))
    out.sort(key=lambda f: (f.step, f.kind in RECOVERY_KINDS))
    return out


def parse_schedule(text: str, persist_every: int) -> list[Fault]:
    """A schedule written by hand, to replay a finding: "kill_keeper@10,kill_worker@20:1" (kind@step[:rank])."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, _, at = item.partition("@")
        step, _, rank = at.partition(":")
        if kind not in ALL_KINDS or not step.isdigit():
            raise ValueError(f"{item!r}: write kind@step[:rank] with kind one of {ALL_KINDS}")
        out.append(Fault(kind, int(step), int(rank or 0), during_save=int(step) % persist_every == 0))
    return sorted(out, key=lambda f: (f.step, f.kind in RECOVERY_KINDS))


def job_chaos(faults: list[Fault]) -> list[dict[str, Any]]:
    return [f.chaos() for f in faults if f.in_job]
