"""A SIMULATION of Unbroken's control path at 1,000 to 10,000 ranks (used by scale_bench.py).

What is real: the supervisor's pieces as the actor runs them: its inbox (`Supervisor.report`), the
failure detector (agents' losses, hangs, stragglers, the root cause), the replica pool's bookkeeping,
the committer's ack aggregation and commit choice, the reporter's metrics rows, the policies; and
each node's agent (workers.node_agent.NodeAggregator) folding its ranks' notes into NodeBatch
messages and watching them. What is simulated: the ranks (light objects sending the real protocol
messages at set step and snapshot times), the clock (virtual: a discrete-event loop), message
latency (`net_s`), Ray's own death reports (times measured in NOTES.md), and the keepers' answer to a
commit (every acked shard is held: keepers are measured on their own by snapshot_bench).

The supervisor is one thread: each call it makes is timed by the CPU it really takes here
(`time.thread_time`), and the virtual clock of the supervisor advances by that much, so a supervisor
that cannot keep up falls behind and detects late, as the real one would. Agents are timed the same
way, each on its own node. Two modes: `agents` (ranks -> node agent -> supervisor) and `flat`
(today's: every rank's notes to the supervisor, which watches every rank itself), the baseline.
"""

from __future__ import annotations

import heapq
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from service.policies import FailureKind, FailurePolicy, Policies, ScalingPolicy, StragglerPolicy
from service.spec import JobSpec
from service.supervisor.actor import Supervisor
from service.supervisor.agents import AgentTracker
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import JobRun
from service.supervisor.detection import Failure, FailureDetector, root_cause
from service.supervisor.generations import Generations, rank_of
from service.supervisor.pool import Replica, ReplicaPool, ReplicaState, Slot
from service.supervisor.reporter import Reporter
from tests.benchmarks.scale_sim_parts import (  # noqa: F401 - KINDS, Params and RAY_NODE_S are this module's API
    KINDS,
    POLL_S,
    RAY_DEATH_S,
    RAY_NODE_S,
    Params,
    _VirtualClock,
    deep_size,
)
from workers.node_agent import CHECK_S, NodeAggregator, agent_groups
from workers.protocol import Heartbeat, SnapshotAck, StepReport


class _Sim:
    def __init__(self, p: Params) -> None:
        if p.mode not in ("agents", "flat") or p.ranks % p.per_node:
            raise ValueError(f"mode={p.mode!r} must be agents|flat and ranks={p.ranks} a multiple of {p.per_node}")
        self.p = p
        self.rng = random.Random(p.seed)
        self.tmp = tempfile.TemporaryDirectory(prefix="scale-sim-")
        spec = JobSpec.model_validate({"name": "scale-sim", "fault_tolerance": {
            "heartbeat_interval_s": p.heartbeat_interval_s, "heartbeat_timeout_s": p.heartbeat_timeout_s,
            "straggler_action": "replace", "max_recoveries": 10**6}})
        self.run = JobRun(job_id="sim", spec=spec, namespace="sim", store=None, restarted=False, self_handle=None,
                          mp=1, cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=p.ranks,
                          output_dir=Path(self.tmp.name))
        self.reporter = Reporter(self.run, None)
        self.reporter.open_outputs()
        self.pool = ReplicaPool(self.run, self.reporter)
        self.committer = SnapshotCommitter(self.run, self.reporter)
        stragglers = StragglerPolicy(spec.fault_tolerance.straggler_factor, "replace")
        self.policies = Policies(FailurePolicy(10**6), ScalingPolicy(1, p.ranks), stragglers)
        self.detector = FailureDetector(self.run, self.reporter, stragglers)
        # The actor's inbox, without starting the actor (no Ray here): its own report() runs.
        self.sup = Supervisor.__new__(Supervisor)
        self.sup.run, self.sup.reporter, self.sup.committer = self.run, self.reporter, self.committer
        # The inbox reads the generations' view (hot spares' count in each metrics row): the real one.
        self.sup.generations = Generations(self.run, self.reporter, self.pool, self.committer, self.detector,
                                           self.policies.scaling)
        self.tracker = self.sup.agents = AgentTracker(
            self.run, self.committer.on_ack, self.sup.report, self.reporter.add_logs, self.reporter.event,
            interval_s=p.agent_interval_s, misses=p.agent_misses, member_misses=p.agent_misses)
        self.nodes = [f"n{i:05d}" for i in range(p.ranks // p.per_node)]
        self.agents = {n: NodeAggregator(f"job-sim/agent-{n}", n, p.heartbeat_timeout_s) for n in self.nodes}
        for a in self.agents.values():
            a.send_on_acks = p.send_on_acks
        self.groups = agent_groups(self.nodes, p.fanin)
        self.leader_of = {m: lead for lead, members in self.groups.items() for m in members}
        self.node_up = dict.fromkeys(self.nodes, True)
        self.state: dict[str, str] = {}  # worker -> ok | dead | hung | slow
        self.heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.now = 0.0
        self.clock = _VirtualClock()
        self.sup_free = 0.0  # the supervisor's virtual clock: busy until then
        self.agent_free = dict.fromkeys(self.nodes, 0.0)
        self.last_flush = dict.fromkeys(self.nodes, -1e9)  # an agent's interval restarts after each batch
        self.acks_sent: dict[tuple[int, int], float] = {}  # (generation, step) -> when its last ack was sent
        self.commit_lag: list[float] = []  # from a step's last ack to its commit by the supervisor
        self.sup_cpu = 0.0
        self.sup_ray_cpu = 0.0  # of which Ray's receiving (recv_cpu_s per message)
        self.agent_cpu = dict.fromkeys(self.nodes, 0.0)
        self.sup_msgs = 0
        self.step = 0
        self.overloaded = False
        self.fault: dict[str, Any] | None = None
        self.results: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}  # (detect_s, decide_s)
        self.wrong: list[str] = []
        self.ray_reports: list[tuple[float, str, str]] = []  # (visible at, kind, worker or node)
        self._start_generation(0)

    # ----------------------------------------------------------------- the job's shape
    def _start_generation(self, generation: int) -> None:
        run, p = self.run, self.p
        names = [f"job-sim/worker-{i}" for i in range(p.ranks)]
        if not self.pool.replicas:
            for i, name in enumerate(names):
                slot = Slot(name, None, i, 0, info={"node_name": self.nodes[i // p.per_node], "pid": None})
                self.pool.replicas[i] = Replica(i, None, [slot], state=ReplicaState.READY)
        reps = self.pool.in_state(ReplicaState.READY)
        dp = len(reps)
        with run.lock:
            run.generation, run.dp = generation, dp
            run.step_reports.clear()
        for d, rep in enumerate(reps):
            rep.state = ReplicaState.ACTIVE
            for s in rep.slots:
                s.rank, s.result = rank_of(d, s.local, dp, run.cp_tp), None
                self.state[s.name] = "ok"
                self.agents[s.info["node_name"]].own(s.name, s.rank, generation, None, self.now)
        self.slots = self.pool.active_slots()
        self.by_node: dict[str, list[Slot]] = {}
        for s in self.slots:
            self.by_node.setdefault(s.info["node_name"], []).append(s)
        self.tracker.expect(self.nodes, self.now, reporters=list(self.groups))
        self.tracker.take_lost()
        for lead, members in self.groups.items():
            self.agents[lead].lead(members, self.now, self.tracker.timeout_s)
        for a in self.agents.values():
            a.flush(self.now)  # the old generation's leftovers go nowhere

    # ----------------------------------------------------------------- the clock
    def at(self, t: float, kind: str, arg: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, arg))

    def _recv_cpu(self, note: Any) -> float:
        """Ray's CPU to receive one message (calibrated: scale_bench measures it)."""
        return self.p.recv_cpu_s + self.p.recv_cpu_per_rank_s * len(getattr(note, "beats", None) or (1,))

    def _sup_call(self, t: float, fn: Any, *args: Any, message: bool = False) -> tuple[Any, float]:
        """Run a supervisor call when the supervisor is free; (its result, when it ended). A message
        (args[0]) also costs Ray's receiving."""
        start = max(t, self.sup_free)
        self.clock.now = start
        c0 = time.thread_time()
        out = fn(*args)
        ray_cpu = self._recv_cpu(args[0]) if message else 0.0
        cpu = time.thread_time() - c0 + ray_cpu
        self.sup_cpu += cpu
        self.sup_ray_cpu += ray_cpu
        self.sup_free = start + cpu
        return out, self.sup_free

    def _agent_call(self, node: str, t: float, fn: Any, *args: Any) -> tuple[Any, float]:
        start = max(t, self.agent_free[node])
        c0 = time.thread_time()
        out = fn(*args)
        cpu = time.thread_time() - c0 + (self._recv_cpu(args[0]) if fn.__name__ == "collect" else 0.0)
        self.agent_cpu[node] += cpu
        self.agent_free[node] = start + cpu
        return out, self.agent_free[node]

    def _deliver(self, node: str, t: float, note: Any) -> None:
        """A rank's note: to its agent, or (flat) to the supervisor."""
        if self.p.mode == "agents":
            urgent, t_end = self._agent_call(node, t, self.agents[node].collect, note, t)
            if urgent:  # a lost rank, a chaos fault, or every local rank's ack for a snapshot: sent now
                self._agent_flush(node, t_end)
        else:
            self.sup_msgs += 1
            self._sup_call(t + self.p.net_s, self.sup.report, note, message=True)

    # ----------------------------------------------------------------- the ranks (simulated)
    def _ranks_step(self, node: str, k: int) -> None:
        if not self.node_up[node]:
            return
        p, gen = self.p, self.run.generation
        for s in self.by_node.get(node, []):
            st = self.state[s.name]
            if st in ("dead", "hung"):
                continue
            gap = self.rng.uniform(0.005, 0.03) + (3.5 * p.step_s if st == "slow" else 0.0)
            t = self.now + gap
            metrics = {"step": k, "loss": 1.0, "generation": gen} if s.rank == 0 else None
            hb = Heartbeat(s.name, gen, s.rank, t, phase="training", step=k, pid=0,
                           last=StepReport(k, gap, p.step_s, 1.0), metrics=metrics)
            if st == "slow":  # seconds late: an event then, so its agent is not busy until it comes
                self.at(t, "note", (node, hb))
            else:
                self._deliver(node, t, hb)
        self.at(self.now + p.snapshot_s, "acks", (node, k, gen))

    def _ranks_ack(self, node: str, k: int, gen: int) -> None:
        if not self.node_up[node] or gen != self.run.generation:
            return
        nxt = self.nodes[(self.nodes.index(node) + 1) % len(self.nodes)] if len(self.nodes) > 1 else node
        self.acks_sent[(gen, k)] = self.now
        for s in self.by_node.get(node, []):
            if self.state[s.name] in ("ok", "slow"):
                self._deliver(node, self.now, SnapshotAck(s.name, gen, s.rank, self.now, step=k, ok=True,
                                                          world_size=self.run.dp, acked=[node, nxt]))

    def _ranks_beat(self, node: str) -> None:
        if not self.node_up[node]:
            return
        for s in self.by_node.get(node, []):
            if self.state[s.name] in ("ok", "slow"):
                self._deliver(node, self.now, Heartbeat(s.name, self.run.generation, s.rank, self.now,
                                                        phase="training", step=self.step, pid=0))

    # ----------------------------------------------------------------- agents and supervisor
    def _agent_check(self, node: str) -> None:
        if not self.node_up[node]:
            return
        state = {"dead": "gone"}
        found, t = self._agent_call(node, self.now, self.agents[node].check, self.now,
                                    lambda r: state.get(self.state.get(r.worker, "ok"), "alive"))
        if found:
            self._agent_flush(node, t)

    def _agent_flush(self, node: str, t: float) -> None:
        if not self.node_up[node]:
            return
        batch, t_end = self._agent_call(node, t, self.agents[node].flush, t)
        self.last_flush[node] = t
        lead = self.leader_of[node]
        if lead != node:  # a member: to its group's leader, which sends on at once what is urgent
            if self.node_up[lead]:
                urgent, t_got = self._agent_call(lead, t_end + self.p.net_s, self.agents[lead].collect, batch, t_end)
                if urgent:
                    self._agent_flush(lead, t_got)
            return
        self.sup_msgs += 1
        self._sup_call(t_end + self.p.net_s, self.sup.report, batch, message=True)

    def _poll(self) -> Failure | None:
        """One pass of the supervisor's watch loop (generations.watch, without Ray's waits)."""
        now, slots = self.now, self.slots
        found: Failure | None = None
        while self.ray_reports and self.ray_reports[0][0] <= now:  # what Ray's own waits report
            _, kind, who = self.ray_reports.pop(0)
            gone = [s for s in slots if s.name == who or (s.info or {}).get("node_name") == who]
            if gone and found is None:
                found = Failure(FailureKind.NODE_DIED if kind == "node" else FailureKind.WORKER_DIED, gone,
                                f"ray reported {who}", now)
        if found is None and self.p.mode == "agents":
            found = self.detector.from_agents(self.tracker.take_lost(), self.tracker.silent(now), slots, now)
        elif found is None:
            found = self.detector.hung(slots, self.run.heartbeats(), now)
        if found is None:
            found = self.detector.check_stragglers(slots)
        self.committer.commit()
        with self.run.lock:  # the keepers' answer (simulated): every acked shard is held
            upto = getattr(self.reporter, "committable_step", self.reporter.last_row_step)
            ready = sorted((k for k, v in self.committer._acks.items() if len(v["ranks"]) >= v["world"]
                            and k[1] <= upto), reverse=True)
            if ready:
                if ready[0] in self.acks_sent and ready[0] != self.committer.committed:
                    self.commit_lag.append(now - self.acks_sent.pop(ready[0]))
                self.committer.committed = ready[0]
                for k in [k for k in self.committer._acks if k <= ready[0]]:
                    self.committer._acks.pop(k)
        return found

    def _decide(self, failure: Failure) -> dict[str, Any]:
        """The controller's recovery decision (controller._recover, without Ray's calls): the cause, the
        policy, replicas dropped, the new dp and ranks, the restore target."""
        run, pool = self.run, self.pool
        f = root_cause([failure])
        decision = self.policies.failures.decide(f.kind, run.recoveries, f.step)
        run.recoveries += 1
        bad = {s.name for s in f.slots}
        for rep in pool.in_state(ReplicaState.ACTIVE):
            if any(s.name in bad for s in rep.slots):
                pool.retire(rep, "lost a member")
            else:
                rep.state = ReplicaState.READY
        dp = self.policies.scaling.choose(pool.count(ReplicaState.READY))
        reps = pool.in_state(ReplicaState.READY)[: dp or 0]
        ranks = {s.name: rank_of(d, s.local, len(reps), run.cp_tp) for d, rep in enumerate(reps) for s in rep.slots}
        return {"recover": decision.recover, "dp": dp, "ranks": len(ranks), "target": self.committer.restore_target()}

    # ----------------------------------------------------------------- faults
    def _inject(self, kind: str) -> None:
        live = [s for s in self.slots if self.state[s.name] == "ok" and self.node_up[s.info["node_name"]]]
        s = self.rng.choice(live)
        node = s.info["node_name"]
        self.fault = {"kind": kind, "t": self.now, "worker": s.name, "node": node}
        if kind == "death":
            self.state[s.name] = "dead"
            if self.p.mode == "flat":
                self.ray_reports.append((self.now + RAY_DEATH_S, "worker", s.name))
        elif kind == "node_loss":
            self.node_up[node] = False
            for x in self.by_node[node]:
                self.state[x.name] = "dead"
            self.ray_reports.append((self.now + RAY_NODE_S, "node", node))
        elif kind == "hang":
            self.state[s.name] = "hung"
        else:
            self.state[s.name] = "slow"
        self.ray_reports.sort()

    def _detected(self, failure: Failure, t_detect: float) -> None:
        fault = self.fault
        assert fault is not None
        expected = {"death": FailureKind.WORKER_DIED, "node_loss": FailureKind.NODE_DIED, "hang": FailureKind.HANG,
                    "straggler": FailureKind.STRAGGLER}[fault["kind"]]
        if failure.kind != expected or not any(fault["node"] == (s.info or {}).get("node_name") for s in failure.slots):
            self.wrong.append(f"{fault['kind']}: detected as {failure.kind} ({failure.detail[:80]})")
        _, t_decided = self._sup_call(t_detect, self._decide, failure)
        self.results[fault["kind"]].append((t_detect - fault["t"], t_decided - t_detect))
        # The re-formed generation: the lost replicas replaced by fresh ones, the dead node back.
        for name, st in list(self.state.items()):
            if st != "ok":
                self.state[name] = "ok"
        for rep in self.pool.in_state(ReplicaState.DEAD):
            self.pool.replicas.pop(rep.index)
            fresh = Slot(rep.slots[0].name, None, rep.index, 0, info=dict(rep.slots[0].info or {}))
            self.pool.replicas[rep.index] = Replica(rep.index, None, [fresh], state=ReplicaState.READY)
        self.node_up = dict.fromkeys(self.nodes, True)
        self.ray_reports.clear()
        self.fault = None
        self._start_generation(self.run.generation + 1)
        self.detector.stragglers.reset()

    # ----------------------------------------------------------------- the loop
    def run_all(self) -> dict[str, Any]:
        p = self.p
        plan = [k for k in KINDS for _ in range(p.trials.get(k, 0))]
        self.rng.shuffle(plan)
        for node in self.nodes:
            off = self.rng.uniform(0, 1)
            self.at(off * p.heartbeat_interval_s, "beat", node)
            if p.mode == "agents":
                self.at(off * p.agent_interval_s, "flush", node)
                self.at(off * CHECK_S, "check", node)
        self.at(p.step_s, "step")
        self.at(POLL_S, "poll")
        self.at(2.0 * p.step_s, "inject")
        t_end = None
        while self.heap:
            self.now, _, kind, arg = heapq.heappop(self.heap)
            if kind == "step":
                self.step += 1
                for node in self.nodes:
                    self._ranks_step(node, self.step)
                self.at(self.now + p.step_s, "step")
            elif kind == "acks":
                self._ranks_ack(*arg)
            elif kind == "note":
                self._deliver(arg[0], self.now, arg[1])
            elif kind == "beat":
                self._ranks_beat(arg)
                self.at(self.now + p.heartbeat_interval_s, "beat", arg)
            elif kind == "flush":  # the agent's interval, restarted by a batch sent at once (NodeAgent)
                due = self.last_flush[arg] + p.agent_interval_s
                if self.now + 1e-9 >= due:
                    self._agent_flush(arg, self.now)
                    due = self.now + p.agent_interval_s
                self.at(due, "flush", arg)
            elif kind == "check":
                self._agent_check(arg)
                self.at(self.now + CHECK_S, "check", arg)
            elif kind == "inject":
                if plan:
                    self._inject(plan.pop())
                elif t_end is None:
                    t_end = self.now
            elif kind == "poll":
                found, t_done = self._sup_call(self.now, self._poll)
                if found is not None and self.fault is not None:
                    self._detected(found, t_done)
                    self.at(self.sup_free + p.gap_s, "inject")
                self.at(max(self.now + POLL_S, self.sup_free), "poll")
            if t_end is not None or self.now > 600.0:
                break
            if self.sup_free - self.now > 30.0:  # the supervisor cannot keep up: it falls behind for good
                self.overloaded = True
                break
        return self._summary(t_end or self.now)

    def _summary(self, duration: float) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

        out: dict[str, Any] = {"ranks": self.p.ranks, "mode": self.p.mode, "nodes": len(self.nodes),
                               "sim_s": duration, "steps": self.step, "wrong": self.wrong, "fanin": self.p.fanin,
                               "overloaded": self.overloaded}
        for k, rows in self.results.items():
            out[k] = {"n": len(rows), "p50": pct([d for d, _ in rows], 0.5), "p99": pct([d for d, _ in rows], 0.99),
                      "decide_p99": pct([c for _, c in rows], 0.99)}
        out["commit_lag_p50"] = pct(self.commit_lag, 0.5)
        out["commit_lag_p99"] = pct(self.commit_lag, 0.99)
        out["sup_cpu_frac"] = self.sup_cpu / duration
        out["sup_cpu_per_step_s"] = self.sup_cpu / max(1, self.step)
        out["agent_cpu_frac"] = statistics.mean(self.agent_cpu.values()) / duration
        out["agent_cpu_max_frac"] = max(self.agent_cpu.values()) / duration  # a group leader's
        out["sup_ray_cpu_frac"] = self.sup_ray_cpu / duration
        out["msgs_per_s"] = self.sup_msgs / duration
        out["sup_state_mb"] = deep_size([self.run.hb, self.run.step_reports, self.committer._acks, self.tracker.seen,
                                         self.tracker.beats, self.pool.replicas]) / 2**20
        out["agent_state_kb"] = deep_size(self.agents[self.nodes[0]]) / 2**10
        self.tmp.cleanup()
        return out


def simulate(p: Params) -> dict[str, Any]:
    """Run one simulation; the supervisor's inbox reads the simulation's clock meanwhile."""
    from service.supervisor import actor

    sim = _Sim(p)
    real, actor.time = actor.time, sim.clock  # type: ignore[assignment]
    try:
        return sim.run_all()
    finally:
        actor.time = real  # type: ignore[assignment]
