"""The re-form's store cost with many clients: a torch TCPStore barrier with 256, 1,024 and 4,096 clients.

Every generation (workers/group.py) opens a fresh TCPStore hosted by its rank 0, and every rank of the
generation connects to it, waits on it and reads the group's keys from it (`init_process_group`: a
barrier-like arrival count and, on NCCL, one key that every rank reads). At 10,000 ranks that one
server and its N connections are the rendezvous. This measures, with N client threads in one process
(each its own TCPStore connection, as a rank is):

    connect   N clients open their connection (TCPStore(..., is_master=False))
    barrier   each client `add`s itself to a counter; the last one sets `go`; all wait for `go`
    bcast     rank 0 `set`s a 128-byte key (NCCL's unique id); the others `get` it

for three designs:

    flat      today: all N ranks on the generation's one store
    tree      the node agents rendezvous for their 8 ranks: N/8 clients on the global store, plus a
              local barrier of 8 (gather, then release) on each node; nodes run in parallel, so the
              local part is measured once and counted twice
    reuse     one long-lived store and connection per rank, a key prefix per generation: the
              re-form pays no connect (the barrier and bcast only)

The client threads share this machine's cores with the server, so the figures are an upper bound
of the server's cost; the server's own rate (ops/s) is printed so a larger N can be extrapolated.
Run: python -m tests.benchmarks.rendezvous_bench [N ...]
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # one warning per client socket otherwise

import torch.distributed as dist  # noqa: E402 - after the log level

HOST = "127.0.0.1"
SIZES = (256, 1024, 4096)
LOCAL = 8  # ranks per node (the tree's fan-in)
TIMEOUT = timedelta(seconds=120)


def _server() -> dist.TCPStore:
    return dist.TCPStore(HOST, 0, 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False)


def _run_threads(n: int, fn: Callable[[int], None]) -> float:
    """Run fn(i) on n threads released together; wall seconds from release to the last return."""
    go = threading.Event()
    ready = threading.Semaphore(0)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        ready.release()
        go.wait()
        try:
            fn(i)
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
    return time.perf_counter() - t0


def measure(n: int, port: int, prefix: str) -> dict[str, float]:
    """connect, barrier and bcast seconds for n clients of the store at `port`."""
    clients: list[dist.TCPStore | None] = [None] * n

    def connect(i: int) -> None:
        clients[i] = dist.TCPStore(HOST, port, n, is_master=False, timeout=TIMEOUT, wait_for_workers=False)

    out = {"connect": _run_threads(n, connect)}
    stores = [dist.PrefixStore(prefix, c) for c in clients if c is not None]

    def barrier(i: int) -> None:
        s = stores[i]
        if s.add("arrived", 1) == n:
            s.set("go", b"1")
        s.wait(["go"])

    out["barrier"] = _run_threads(n, barrier)
    uid = b"x" * 128

    def bcast(i: int) -> None:
        s = stores[i]
        if i == 0:
            s.set("uid", uid)
        elif s.get("uid") != uid:
            raise AssertionError("wrong unique id")

    out["bcast"] = _run_threads(n, bcast)
    # A second generation on the same connections (the `reuse` design): prefix per generation.
    stores = [dist.PrefixStore(prefix + "next/", c) for c in clients if c is not None]
    out["barrier_reuse"] = _run_threads(n, barrier)
    out["bcast_reuse"] = _run_threads(n, bcast)
    clients.clear()  # the connections close with their last reference
    return out


def server_ops_per_s(port: int, clients: int = 8, ops: int = 4000) -> float:
    """The server's rate of `add` calls from a few clients (its cost per operation, inverted)."""
    stores = [dist.TCPStore(HOST, port, 1, is_master=False, timeout=TIMEOUT, wait_for_workers=False)
              for _ in range(clients)]
    per = ops // clients

    def work(i: int) -> None:
        for _ in range(per):
            stores[i].add("ops", 1)

    wall = _run_threads(clients, work)
    return per * clients / wall


def run(sizes: tuple[int, ...] = SIZES, repeats: int = 3) -> dict[int, dict[str, float]]:
    server = _server()
    port = int(server.port)
    results: dict[int, dict[str, float]] = {}
    local = [measure(LOCAL, port, f"local{r}/") for r in range(repeats)]
    local_barrier = statistics.median(x["barrier"] for x in local)
    for n in sizes:
        flat = [measure(n, port, f"flat{n}-{r}/") for r in range(repeats)]
        tree = [measure(max(1, n // LOCAL), port, f"tree{n}-{r}/") for r in range(repeats)]

        def med(rows: list[dict[str, float]], key: str) -> float:
            return statistics.median(x[key] for x in rows)

        results[n] = {
            "flat_connect": med(flat, "connect"), "flat_barrier": med(flat, "barrier"), "flat_bcast": med(flat, "bcast"),
            "reuse_barrier": med(flat, "barrier_reuse"), "reuse_bcast": med(flat, "bcast_reuse"),
            "tree_connect": med(tree, "connect"),
            # gather on the node, the global barrier of the agents, release on the node
            "tree_barrier": med(tree, "barrier") + 2 * local_barrier, "tree_bcast": med(tree, "bcast") + local_barrier,
        }
    results[0] = {"server_ops_per_s": server_ops_per_s(port), "local_barrier": local_barrier}
    return results


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    sizes = tuple(int(a) for a in args) if args else SIZES
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(sizes) + 512  # a client socket and the server's socket per client
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))
    threading.stack_size(256 * 1024)
    res = run(sizes)
    extra = res.pop(0)
    print(f"TCPStore rendezvous, median of 3, client threads on this machine; server "
          f"{extra['server_ops_per_s']:,.0f} ops/s; a node's local barrier of {LOCAL}: "
          f"{extra['local_barrier'] * 1e3:.1f} ms")
    print(f"{'clients':>8} | {'flat connect':>12} {'barrier':>8} {'bcast':>8} | {'reuse barrier':>13} "
          f"{'bcast':>8} | {'tree connect':>12} {'barrier':>8} {'bcast':>8} | {'flat/tree re-form':>17}")
    for n, r in res.items():
        flat = r["flat_connect"] + r["flat_barrier"] + r["flat_bcast"]
        tree = r["tree_connect"] + r["tree_barrier"] + r["tree_bcast"]
        print(f"{n:>8} | {r['flat_connect']:>11.3f}s {r['flat_barrier']:>7.3f}s {r['flat_bcast']:>7.3f}s | "
              f"{r['reuse_barrier']:>12.3f}s {r['reuse_bcast']:>7.3f}s | {r['tree_connect']:>11.3f}s "
              f"{r['tree_barrier']:>7.3f}s {r['tree_bcast']:>7.3f}s | {flat / tree:>16.1f}x")
    n = max(res)
    r = res[n]
    print(f"rendezvous: clients={n} flat_s={r['flat_connect'] + r['flat_barrier'] + r['flat_bcast']:.3f} "
          f"reuse_s={r['reuse_barrier'] + r['reuse_bcast']:.3f} "
          f"tree_s={r['tree_connect'] + r['tree_barrier'] + r['tree_bcast']:.3f}")


if __name__ == "__main__":
    main()
