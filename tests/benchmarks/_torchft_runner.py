"""goodput_bench's TorchFT side: a lighthouse, 4 replica-group processes (one rank each) and a restarter.

Each replica builds the same model and optimizer as our Trainer at world 1 (same init seed), takes data
shard `replica` of 4 at each step (our loader), averages gradients over the quorum with the Manager's
allreduce (one flat buffer; torchft 0.2.0's DDP comm hook asserts when a peer dies), and
commits through OptimizerWrapper. A restarted replica heals from a live peer (torchft's HTTP transport).
Needs the `bench` extra (torchft==0.2.0).

Replica entry point: python -m tests.benchmarks._torchft_runner '<json config>'
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_best_timeout: float | None = None  # chosen by the fault-free calibration, used by the faulty run


def _engine() -> dict[str, Any]:
    from tests.benchmarks.goodput_bench import MODEL, TRAINING

    return {"model": MODEL, "training": {**TRAINING}, "parallelism": {"dp_shard": 1}}


def replica(cfg: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from parallel.config import EngineConfig
    from parallel.data import IGNORE_INDEX
    from parallel.loss import token_loss_sum
    from parallel.optim import clip_grad_norm_, set_scheduler_step
    from parallel.trainer import Trainer
    from workers.ports import free_port

    torch.set_num_threads(1)
    rid, world, steps, t_out = cfg["replica"], cfg["world"], cfg["steps"], cfg["timeout_s"]
    engine = EngineConfig.model_validate(cfg["engine"])
    trainer = Trainer(engine, device=torch.device("cpu"))
    model, opt = trainer.model, trainer.optimizer
    params = [p for p in model.parameters() if p.requires_grad]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    # The replica group's store: torchelastic's agent would host it; the Manager only connects to it.
    store_port = free_port()
    store = TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=t_out)), min_replica_size=1,
        load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"replica{rid}",
        store_addr="127.0.0.1", store_port=store_port, rank=0, world_size=1,
        lighthouse_addr=cfg["lighthouse"], hostname="127.0.0.1", timeout=timedelta(seconds=t_out),
        quorum_timeout=timedelta(seconds=120), init_sync=False,
    )  # fmt: skip
    hb = Path(cfg["hb"])

    def beat() -> None:  # a side thread, like our workers': a SIGSTOPped process stops beating
        while True:
            hb.write_text(str(time.time()))
            time.sleep(0.5)

    # From here on (imports and the build can hold the GIL for seconds on a loaded machine).
    threading.Thread(target=beat, daemon=True).start()
    wrapped = OptimizerWrapper(manager, opt)
    ready = Path(cfg["ready_dir"])
    (ready / str(rid)).write_text("1")
    while cfg["first"] and len(list(ready.iterdir())) < cfg["replicas"]:  # the first start: all at once
        time.sleep(0.05)
    with open(cfg["log"], "a") as log:
        while manager.current_step() < steps:
            wrapped.zero_grad()  # starts the quorum
            manager.wait_quorum()  # a healing replica's step is the quorum's from here
            step = manager.current_step()
            set_scheduler_step(trainer.scheduler, step)
            loss_sum = torch.zeros(())
            tokens = 0
            for batch in trainer.data.micro_batches(step, rid, world):
                logits = model(batch.inputs)
                loss_sum = loss_sum + token_loss_sum(logits, batch.targets)
                tokens += int((batch.targets != IGNORE_INDEX).sum())
            (loss_sum / max(tokens, 1)).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
            clip_grad_norm_(params, engine.training.grad_clip)
            wrapped.step()  # the optimizer steps only if every participant's step went through
            committed = manager.current_step() > step
            log.write(json.dumps({"step": step + 1, "time": time.time(), "loss": float(loss_sum) / max(tokens, 1),
                                  "committed": committed, "replica": rid}) + "\n")
            log.flush()
    manager.shutdown(wait=False)
    del store
    os._exit(0)  # skip interpreter teardown (torchft's native threads)


class _Fleet:
    """The replica processes and their restarter (torchelastic's role)."""

    def __init__(self, tmp: Path, lighthouse: str, timeout_s: float, replicas: int | None = None) -> None:
        """`replicas`: how many replica groups (replicas 0..n-1, each still its shard of WORLD's data: a
        fault-free run at the width a faulty run dropped to); WORLD by default."""
        from tests.benchmarks.goodput_bench import HB_TIMEOUT_S, NODE_BACK_S, STEPS, WORLD

        self.tmp, self.world, self.steps, self.hb_timeout, self.node_back = tmp, WORLD, STEPS, HB_TIMEOUT_S, NODE_BACK_S
        (tmp / "ready").mkdir(parents=True)
        replicas = WORLD if replicas is None else replicas
        self.base = {"world": WORLD, "replicas": replicas, "steps": STEPS, "timeout_s": timeout_s, "lighthouse": lighthouse,
                     "engine": _engine(), "ready_dir": str(tmp / "ready")}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.down_until: dict[int, float] = {}  # replica -> its "node" returns then
        self.restarts = 0
        self.tick: Any = None  # the injector's main-thread tick
        self.lock = threading.Lock()
        for r in range(replicas):
            self._start(r, first=True)

    def _start(self, r: int, first: bool = False) -> None:
        cfg = {**self.base, "replica": r, "first": first, "log": str(self.tmp / f"r{r}.jsonl"),
               "hb": str(self.tmp / f"hb{r}")}
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        out = open(self.tmp / f"r{r}.out", "ab")  # noqa: SIM115 - the child keeps it
        self.procs[r] = subprocess.Popen([sys.executable, "-m", "tests.benchmarks._torchft_runner", json.dumps(cfg)],
                                         cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        Path(cfg["hb"]).write_text(str(time.time() + 120))  # start-up grace: it beats once built

    def pids(self) -> dict[int, int]:
        with self.lock:
            return {r: p.pid for r, p in self.procs.items() if p.poll() is None}

    def kill_node(self) -> None:
        """SIMULATION of node b's loss: SIGKILL the replicas placed on it (2 and 3)."""
        with self.lock:
            for r in (2, 3):
                self.down_until[r] = time.time() + self.node_back
                if self.procs[r].poll() is None:
                    self.procs[r].kill()

    def supervise(self, timeout_s: float = 1500.0) -> None:
        """Until some replica finished every step: restart exited replicas, kill hung ones."""
        deadline = time.time() + timeout_s
        while True:
            if self.tick is not None:
                self.tick()
            if time.time() > deadline:
                raise TimeoutError(f"torchft: no replica finished {self.steps} steps within {timeout_s:.0f}s")
            done = [r for r, p in self.procs.items() if p.poll() == 0]
            if done:
                return
            now = time.time()
            with self.lock:
                for r, p in self.procs.items():
                    if p.poll() is None:
                        hb = self.tmp / f"hb{r}"
                        try:
                            seen = float(hb.read_text())
                        except ValueError:  # caught mid-write
                            seen = now
                        if now - seen > self.hb_timeout:
                            p.kill()  # hung: missed heartbeats
                            p.wait()
                        continue
                    if now >= self.down_until.get(r, 0.0):
                        with open(self.tmp / f"r{r}.out", "a") as f:  # why it ended, for whoever reads the run
                            f.write(f"[restarter] replica {r} exited with {p.returncode}; restarting\n")
                        self.restarts += 1
                        self._start(r)
            time.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


class _Lighthouse:
    """torchft's lighthouse as its own process (its CLI), so its per-tick log goes to a file, not our output."""

    def __init__(self, log: Path) -> None:
        import socket

        from workers.ports import free_port

        port = free_port()
        self.address = f"http://127.0.0.1:{port}"
        self.out = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{port}", "--min_replicas", "1",
             "--join_timeout_ms", "2000", "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "2000"],
            stdout=self.out, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.time() + 60
        while True:  # listening before any replica asks it for a quorum
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"torchft lighthouse did not start; see {log}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.out.close()


def _outcome(tmp: Path, fired: list[str]) -> Any:
    from tests.benchmarks.goodput_bench import WORLD, Outcome

    entries = []
    for r in range(WORLD):
        f = tmp / f"r{r}.jsonl"
        if f.exists():
            entries += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    entries.sort(key=lambda e: e["time"])
    committed: dict[int, list[dict[str, Any]]] = {}
    for e in entries:
        if e["committed"]:
            committed.setdefault(e["step"], []).append(e)
    steps = [(s, min(e["time"] for e in es), sum(e["loss"] for e in es) / len(es))
             for s, es in sorted(committed.items())]
    widths = [(len(es), 0) for _, es in sorted(committed.items())]  # replicas that committed each step
    # A step attempt thrown away (its quorum broke) costs one step on every replica: count attempts
    # of the replica that made the most of them.
    lost = max((sum(1 for e in entries if e["replica"] == r and not e["committed"]) for r in range(WORLD)),
               default=0)
    return Outcome(steps[-1][1] - steps[0][1], steps, lost, fired, widths=widths)


def _run_once(tmp: Path, faults: list[Any], timeout_s: float, replicas: int | None = None) -> tuple[Any, int]:
    from tests.benchmarks.goodput_bench import Injector

    tmp.mkdir(parents=True)
    lh = _Lighthouse(tmp / "lighthouse.log")
    fleet = _Fleet(tmp, lh.address, timeout_s, replicas)

    def first_step() -> float | None:
        f = tmp / "r0.jsonl"
        return float(json.loads(f.read_text().splitlines()[0])["time"]) if f.exists() and f.read_text() else None

    inj = Injector(faults, fleet.pids, fleet.kill_node, lambda: None, first_step) if faults else None
    fleet.tick = inj.tick if inj is not None else None
    try:
        fleet.supervise()
    finally:
        if inj is not None:
            inj.stop()
        fleet.stop()
        lh.stop()
    return _outcome(tmp, inj.fired if inj else []), fleet.restarts


def run_torchft(tmp: Path, faults: list[Any], timeouts: tuple[float, ...]) -> tuple[Any, str]:
    """Fault-free (faults=[]): the shortest timeout whose run commits every step; faulty: that timeout."""
    global _best_timeout
    if not faults:
        for t in timeouts:
            out, restarts = _run_once(tmp / f"t{t:g}", [], t)
            if out.lost_steps == 0 and restarts == 0:
                _best_timeout = t
                return out, f"gloo timeout {t:g}s (shortest fault-free of {list(timeouts)})"
            print(f"  torchft: gloo timeout {t:g}s had {out.lost_steps} spurious failed step(s), {restarts} restart(s)")
        raise RuntimeError(f"torchft: no timeout of {list(timeouts)} ran fault-free")
    assert _best_timeout is not None, "run the fault-free calibration first"
    out, restarts = _run_once(tmp, faults, _best_timeout)
    return out, f"gloo timeout {_best_timeout:g}s, {restarts} restarts"


def run_torchft_width(tmp: Path, replicas: int, timeout_s: float | None = None) -> Any:
    """Fault-free with `replicas` replica groups, at `timeout_s` or else the timeout the calibration
    chose: the step time at the width a faulty run dropped to."""
    timeout_s = timeout_s if timeout_s is not None else _best_timeout
    assert timeout_s is not None, "run the fault-free calibration first, or give a timeout"
    return _run_once(tmp, [], timeout_s, replicas)[0]


if __name__ == "__main__":
    replica(json.loads(sys.argv[1]))
