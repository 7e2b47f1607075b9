"""The re-form's store cost with many clients, through the real rendezvous (workers.group.rendezvous).

Every generation opens a fresh TCPStore hosted by its rank 0. `workers.group.rendezvous` is what each
rank runs before torch's `init_process_group`; this times it with N client threads in one process
(each rank its own connections, as in a real rank), for its two designs:

    flat   every rank connects to the master store and checks in there (add; the last sets `go`)
    tree   ranks in nodes of 8 (`local_ranks`): each node's lowest rank leads; it opens the node's relay
           (workers.node_relay.NodeRelay) and checks its node in with the master as one; the others connect
           only to their leader's relay (a local store) and wait for its release

and then a 128-byte unique id (NCCL's) set by rank 0 and read by every rank through its store (the
relay reads it from the master once per node). `connect+barrier` is the rendezvous call itself.

Then torch's own part, which the rendezvous does not change: gloo's `ProcessGroupGloo` built on the
rendezvous' stores (each rank writes its address and reads every rank's: W^2 reads on the master when
flat; through the relays each node reads each address once, W^2/8), at a few small world sizes.

The threads share this machine's cores with the servers, so the figures are upper bounds of the
server's cost; the master's own rate (ops/s) is printed so a larger N can be extrapolated. Threads
add one artefact: in one process, bursts of TCPStore clients sometimes stall 5-10 s (seen from 32
clients at once; 40 separate processes connecting at once took 0.10 s median, 0.81 s max), in either
design; the median of 3 runs is printed with the slowest (max). And all relays and ranks share one
process here (one GIL): the relays' Python costs the tree time that separate nodes would not.
Run: python -m tests.benchmarks.rendezvous_bench [N ...]   (default 256 1024 4096; ~2 min here)
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one warning per client socket otherwise

import torch  # noqa: E402 - after the log level
import torch.distributed as dist  # noqa: E402

from workers.group import rendezvous  # noqa: E402

HOST = "127.0.0.1"
SIZES = (256, 1024, 4096)
GLOO_SIZES = (8, 16, 32)
LOCAL = 8  # ranks per node (the tree's fan-in)
TIMEOUT_S = 180.0
_gens = itertools.count(1)  # every measurement is its own generation: its own keys and relays


def _run_threads(n: int, fn: Callable[[int], Any]) -> tuple[float, list[Any]]:
    """Run fn(i) on n threads released together: (wall seconds from release to the last return, results)."""
    go = threading.Event()
    ready = threading.Semaphore(0)
    errors: list[BaseException] = []
    out: list[Any] = [None] * n

    def body(i: int) -> None:
        ready.release()
        go.wait()
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        ready.acquire()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, out


def _layout(n: int, tree: bool) -> list[list[int] | None]:
    return [list(range(i - i % LOCAL, min(n, i - i % LOCAL + LOCAL))) if tree else None for i in range(n)]


def measure(n: int, master: dist.TCPStore, tree: bool) -> dict[str, float]:
    """The real rendezvous of n ranks (flat or tree), then a unique id read by all; seconds of each."""
    gen, port, layout = next(_gens), int(master.port), _layout(n, tree)

    def join(i: int) -> Any:
        return rendezvous(gen, i, n, HOST, port, timeout_s=TIMEOUT_S, master_store=master if i == 0 else None,
                          local_ranks=layout[i])

    t_join, rdvs = _run_threads(n, join)
    uid, key = b"x" * 128, f"uid/gen{gen}"
    rdvs[0].store.set(key, uid)

    def read(i: int) -> None:
        if rdvs[i].store.get(key) != uid:
            raise AssertionError("wrong unique id")

    t_bcast, _ = _run_threads(n, read)
    reads = sum(r.relay.stats["master_reads"] for r in rdvs if r.relay is not None)
    for r in rdvs:
        r.close()
    return {"join": t_join, "bcast": t_bcast, "relay_master_reads": reads}


def gloo_init(w: int, master: dist.TCPStore, tree: bool) -> dict[str, float]:
    """ProcessGroupGloo of w ranks (threads) built on the rendezvous' stores: its full-mesh address
    exchange through them. Seconds, and the relays' reads from the master (tree)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    gen, port, layout = next(_gens), int(master.port), _layout(w, tree)

    def join(i: int) -> Any:
        return rendezvous(gen, i, w, HOST, port, timeout_s=TIMEOUT_S, master_store=master if i == 0 else None,
                          local_ranks=layout[i])

    _, rdvs = _run_threads(w, join)

    def init(i: int) -> Any:
        pg = ProcessGroupGloo(dist.PrefixStore(f"pg{gen}/", rdvs[i].store), i, w, timedelta(seconds=TIMEOUT_S))
        t = torch.ones(1)
        pg.allreduce([t]).wait()
        if t.item() != w:
            raise AssertionError("wrong sum")
        return pg

    t_init, pgs = _run_threads(w, init)
    reads = sum(r.relay.stats["master_reads"] for r in rdvs if r.relay is not None)
    pgs.clear()
    for r in rdvs:
        r.close()
    return {"init": t_init, "relay_master_reads": reads}


class _Counting(dist.Store):
    """A store that counts what torch asks of it (gloo's full mesh, seen from one rank's side)."""

    def __init__(self, inner: dist.Store, counts: dict[str, int], lock: threading.Lock) -> None:
        super().__init__()
        self.inner, self.counts, self.lock = inner, counts, lock

    def _n(self, op: str, nbytes: int = 0) -> None:
        with self.lock:
            self.counts[op] = self.counts.get(op, 0) + 1
            self.counts[op + "_bytes"] = self.counts.get(op + "_bytes", 0) + nbytes

    def set(self, key: str, value: Any) -> None:
        self._n("set", len(value))
        self.inner.set(key, bytes(value))

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._n("get", len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self._n("add")
        return self.inner.add(key, amount)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._n("wait")
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        self._n("check")
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._n("multi_get")
        return self.inner.multi_get(keys)


def gloo_store_ops(w: int, master: dist.TCPStore) -> dict[str, int]:
    """What gloo's ProcessGroupGloo asks of the store, counted over w ranks (threads, flat)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    counts: dict[str, int] = {}
    lock = threading.Lock()
    gen = next(_gens)
    stores = [_Counting(dist.TCPStore(HOST, int(master.port), 1, is_master=False, timeout=timedelta(seconds=TIMEOUT_S),
                                      wait_for_workers=False), counts, lock) for _ in range(w)]

    def init(i: int) -> Any:
        return ProcessGroupGloo(dist.PrefixStore(f"count{gen}/", stores[i]), i, w, timedelta(seconds=TIMEOUT_S))

    _run_threads(w, init)
    return counts


def server_ops_per_s(port: int, clients: int = 8, ops: int = 4000) -> float:
    """The server's rate of `add` calls from a few clients (its cost per operation, inverted)."""
    stores = [dist.TCPStore(HOST, port, 1, is_master=False, timeout=timedelta(seconds=TIMEOUT_S),
                            wait_for_workers=False) for _ in range(clients)]
    per = ops // clients

    def work(i: int) -> None:
        for _ in range(per):
            stores[i].add("ops", 1)

    wall, _ = _run_threads(clients, work)
    return per * clients / wall


def run(sizes: tuple[int, ...] = SIZES, repeats: int = 3) -> dict[str, Any]:
    master = dist.TCPStore(HOST, 0, 1, is_master=True, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    out: dict[str, Any] = {"sizes": {}, "gloo": {}}
    for n in sizes:
        row: dict[str, float] = {}
        for design in ("flat", "tree"):
            runs = [measure(n, master, design == "tree") for _ in range(repeats)]
            for k in ("join", "bcast", "relay_master_reads"):
                row[f"{design}_{k}"] = statistics.median(r[k] for r in runs)
            row[f"{design}_join_max"] = max(r["join"] for r in runs)
        out["sizes"][n] = row
    for w in GLOO_SIZES:
        out["gloo"][w] = {d: gloo_init(w, master, d == "tree") for d in ("flat", "tree")}
        out["gloo"][w]["ops"] = gloo_store_ops(w, master)
    out["server_ops_per_s"] = server_ops_per_s(int(master.port))
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    sizes = tuple(int(a) for a in args) if args else SIZES
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 6 * max(sizes) + 1024  # each rank's connections and the servers' ends of them
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))
    threading.stack_size(512 * 1024)
    res = run(sizes)
    print(f"workers.group.rendezvous, median of 3, rank threads on this machine; master store "
          f"{res['server_ops_per_s']:,.0f} ops/s; tree: nodes of {LOCAL}")
    print(f"{'ranks':>6} | {'flat connect+barrier (max)':>26} {'uid read':>8} {'total':>7} | "
          f"{'tree connect+barrier (max)':>26} {'uid read':>8} {'total':>7} {'uid master reads':>16} | {'flat/tree':>9}")
    for n, r in res["sizes"].items():
        flat, tree = r["flat_join"] + r["flat_bcast"], r["tree_join"] + r["tree_bcast"]
        print(f"{n:>6} | {r['flat_join']:>16.3f}s ({r['flat_join_max']:>6.2f}s) {r['flat_bcast']:>7.3f}s {flat:>6.3f}s | "
              f"{r['tree_join']:>16.3f}s ({r['tree_join_max']:>6.2f}s) {r['tree_bcast']:>7.3f}s {tree:>6.3f}s "
              f"{r['tree_relay_master_reads']:>16.0f} | {flat / tree:>8.1f}x")
    print("torch's own part, unchanged by the rendezvous: gloo's full mesh (every rank reads every rank's address)")
    print(f"{'ranks':>6} | {'store ops per rank (counted, flat)':>44} | {'flat init':>9} {'master reads':>12} | "
          f"{'tree init':>9} {'master reads':>12}")
    for w, g in res["gloo"].items():
        ops = g["ops"]
        per = (f"{ops.get('set', 0) / w:.0f} set, {ops.get('wait', 0) / w:.0f} wait, {ops.get('get', 0) / w:.0f} get "
               f"of {ops.get('get_bytes', 0) / max(1, ops.get('get', 0)):.0f} B")
        # tree: the relays' reads, plus the leaders' own (each reads every address itself)
        leaders = len({i - i % LOCAL for i in range(w)})
        print(f"{w:>6} | {per:>44} | {g['flat']['init']:>8.3f}s {ops.get('get', 0):>12} | {g['tree']['init']:>8.3f}s "
              f"{g['tree']['relay_master_reads'] + leaders * w:>12.0f}")
    n = max(res["sizes"])
    r = res["sizes"][n]
    print(f"rendezvous: clients={n} flat_s={r['flat_join'] + r['flat_bcast']:.3f} "
          f"tree_s={r['tree_join'] + r['tree_bcast']:.3f}")


if __name__ == "__main__":
    main()
