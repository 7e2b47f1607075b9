"""Rank functions of the group tests (spawned processes: module level, so they pickle)."""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Two "nodes" on this machine: rank 0 alone, ranks 1, 2, 3 together (rank 1 leads them).
LAYOUT = [[0], [1, 2, 3]]
# Generation 3 times out (rank 3 never comes); long enough for rank 2 to reach its leader on a loaded machine.
GEN3_TIMEOUT_S = 6.0


def _node_of(rank: int, layout: list[list[int]]) -> list[int]:
    return next(n for n in layout if rank in n)


def _master(rank: int, world: int, port: int, timeout_s: float) -> Any:
    """Rank 0's master store of a generation (the supervisor's, in a job); None on the other ranks."""
    from parallel import dist as pdist

    return pdist.make_store("127.0.0.1", port, world, is_master=True, timeout_s=timeout_s) if rank == 0 else None


def _join(gen: int, rank: int, world: int, port: int, layout: list[list[int]] | None, timeout_s: float,
          master: Any = None) -> Any:
    import torch

    from workers.group import join_group

    master = master if master is not None else _master(rank, world, port, timeout_s)
    return join_group(gen, rank, world, "127.0.0.1", port, device=torch.device("cpu"), timeout_s=timeout_s,
                      master_store=master, local_ranks=_node_of(rank, layout) if layout else None)


def _sum(world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return float(t[0])


def reform(rank: int, world: int, ports: list[int], out: str) -> None:
    """Generation 0 through the two-level rendezvous (gloo), a sub-group formed through the relay, a
    key read by both non-leaders of the node (the relay reads it from the master once); generation 1
    re-formed smaller in the same processes (rank 3 gone); generation 2 flat; generation 3 with rank 3
    missing, which must fail with the count of ranks that arrived."""
    os.environ["OMP_NUM_THREADS"] = "1"
    result: dict[str, Any] = {}
    try:
        import torch.distributed as dist

        from workers import group, node_relay

        info = _join(0, rank, world, ports[0], LAYOUT, timeout_s=60)
        result["gen0_kind"] = info.rendezvous
        result["gen0_sum"] = _sum(world)
        sub = dist.new_group([1, 2, 3])  # its keys go through the store too (the relay, for ranks 2 and 3)
        if rank in (1, 2, 3):
            import torch

            t = torch.ones(2)
            dist.all_reduce(t, group=sub)
            result["sub_sum"] = float(t[0])
        rdv = group._current
        assert rdv is not None
        result["has_master_connection"] = rdv.local is None
        # The relay's cache, deterministically: rank 0 writes a key; rank 2 reads it (a master read), then
        # rank 3 (from the cache). The leader reports its counts before and after.
        if rank == 0:
            rdv.store.set("probe", b"v")
        stats: list[Any] = [None] * world
        dist.all_gather_object(stats, dict(rdv.relay.stats) if rdv.relay else None)
        result["stats_before"] = stats[1]
        if rank == 2:
            result["probe"] = rdv.store.get("probe")
        dist.barrier()
        if rank == 3:
            result["probe"] = rdv.store.get("probe")
        dist.barrier()
        dist.all_gather_object(stats, dict(rdv.relay.stats) if rdv.relay else None)
        result["stats_after"] = stats[1]

        if rank == 3:  # generation 1 goes on without rank 3
            group.leave_group()
            result["left"] = True
        else:
            # Generation 3's master listens before anyone looks for it, as the supervisor's does: a leader
            # that came first would otherwise count its wait for the master against the arrival timeout.
            master3 = _master(rank, world, ports[3], timeout_s=GEN3_TIMEOUT_S)
            info = _join(1, rank, 3, ports[1], [[0], [1, 2]], timeout_s=60)
            result["gen1_kind"] = info.rendezvous
            result["gen1_sum"] = _sum(3)
            info = _join(2, rank, 3, ports[2], None, timeout_s=60)
            result["gen2_kind"] = info.rendezvous
            result["gen2_sum"] = _sum(3)
            try:
                _join(3, rank, world, ports[3], LAYOUT, timeout_s=GEN3_TIMEOUT_S, master=master3)  # rank 3 never comes
                result["gen3"] = "joined"
            except Exception as e:  # noqa: BLE001 - the expected failure, reported to the test
                result["gen3"] = f"{type(e).__name__}: {e}"
            # Generation 4: rank 3 never comes, and the abort (the supervisor's, after it lost rank 3)
            # reaches ranks 0 and 1 only. Each releases what it hosts (0 the master, 1 its relay); rank 2
            # leaves on the value its leader wrote, well before the 60 s timeout.
            if rank in (0, 1):
                threading.Timer(1.0, group.abort_rendezvous, args=(4,)).start()
            t0 = time.monotonic()
            try:
                _join(4, rank, world, ports[4], LAYOUT, timeout_s=60)
                result["gen4"] = "joined"
            except Exception as e:  # noqa: BLE001 - the expected way out, reported to the test
                result["gen4"] = f"{type(e).__name__}: {e}"
            result["gen4_s"] = time.monotonic() - t0
        group.leave_group()
        result["port_files"] = sorted(p.name for p in node_relay.RENDEZVOUS_DIR.glob(f"*_{ports[0]}_*"))
    except BaseException:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def lost_while_connecting(rank: int, world: int, port: int, out: str, tree: bool) -> None:
    """Every rank arrives; the last one is then lost before gloo's mesh connects (its process exits where
    init_process_group begins), so the others wait in the store for its address. A second after it is
    gone they get the abort a worker gets from its supervisor (`abort_rendezvous`)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    result: dict[str, Any] = {}
    lost = Path(out, "lost")
    try:
        from parallel import dist as pdist
        from workers import group

        if rank == world - 1:
            def gone(*_: Any, **__: Any) -> None:
                lost.touch()
                os._exit(0)

            pdist.init_process_group = gone  # type: ignore[assignment]
        else:
            def abort_after_loss() -> None:
                while not lost.exists():
                    time.sleep(0.02)
                result["lost_seen_at"] = time.perf_counter()
                time.sleep(1.0)  # the others are in gloo's connect by then
                result["aborted_at"] = time.perf_counter()
                group.abort_rendezvous(0)

            threading.Thread(target=abort_after_loss, daemon=True).start()
        try:
            _join(0, rank, world, port, [[0], list(range(1, world))] if tree else None, timeout_s=60)
            result["joined"] = True
        except Exception as e:  # noqa: BLE001 - the outcome under test
            result["error"] = f"{type(e).__name__}: {e}"
        left = time.perf_counter()
        result["left_after_abort_s"] = left - result.get("aborted_at", float("nan"))
        result["left_after_loss_s"] = left - result.get("lost_seen_at", float("nan"))
    except Exception:  # noqa: BLE001
        result["crash"] = traceback.format_exc()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
