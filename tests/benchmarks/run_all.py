"""`make bench`: run every tests/benchmarks/*_bench.py module's `main()` in turn.

Each module prints its own table of figures (ratios measured in the same run). A module that
fails is reported and the others still run; the exit code is non-zero if any failed.
Usage: python -m tests.benchmarks.run_all [NAME ...]   (NAME: e.g. `engine` for engine_bench)
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def discover(names: list[str] | None = None) -> list[str]:
    """Module names of the benchmarks, sorted; only those named when names are given."""
    found = sorted(p.stem for p in HERE.glob("*_bench.py"))
    if names:
        wanted = {n if n.endswith("_bench") else f"{n}_bench" for n in names}
        unknown = wanted - set(found)
        if unknown:
            raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; available: {found}")
        found = [f for f in found if f in wanted]
    return found


def main(argv: list[str] | None = None) -> int:
    names = discover(sys.argv[1:] if argv is None else argv)
    failed: list[str] = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f"tests.benchmarks.{name}")
            module.main()
        except Exception:  # one broken benchmark must not hide the others' figures
            traceback.print_exc()
            failed.append(name)
        print(f"--- {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    print(f"\n{len(names) - len(failed)}/{len(names)} benchmarks ran" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
