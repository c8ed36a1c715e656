"""``python -m bench.suggest``: the time of ``pattern_infra.suggest`` at 10k and 100k ops, side by side.

The program is :func:`bench.llm_workloads.synthetic_mix` (residual units of layer norm, linear, GELU and
conv/batch-norm). Two rows per size: ``suggest`` as it runs by default (the registered passes' matches
found first and left out) and with ``covered_by=()`` (every op mined). The last column is the time per
op; the ratio printed is the 100k time over the 10k one (10 for a linear cost).

Usage::

    python -m bench.suggest                 # 10k and 100k ops
    python -m bench.suggest --sizes 10000   # one size
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse
import time

from .llm_workloads import synthetic_mix
from .workloads import bench_main

__all__ = ["main"]


def _time(prog: object, **kwargs: object) -> tuple[float, int]:
    from pattern_infra import suggest

    start = time.perf_counter()
    found = suggest(prog, **kwargs)
    return time.perf_counter() - start, len(found)


def run(sizes: list[int]) -> int:
    import generic_passes  # noqa: F401  (registers the passes whose matches are left out)

    rows: dict[tuple[str, int], float] = {}
    print(f"{'ops':>8} {'mode':>12} {'seconds':>9} {'candidates':>10} {'us/op':>8}")
    for n in sizes:
        prog = synthetic_mix(n)
        ops = sum(1 for op in prog.functions["main"].operations if op.op_type != "const")
        for mode, kwargs in (("default", {}), ("uncovered", {"covered_by": ()})):
            seconds, found = _time(prog, **kwargs)
            rows[(mode, n)] = seconds
            print(f"{ops:8d} {mode:>12} {seconds:9.2f} {found:10d} {1e6 * seconds / ops:8.1f}")
    if len(sizes) >= 2:
        small, large = sizes[0], sizes[-1]
        for mode in ("default", "uncovered"):
            ratio = rows[(mode, large)] / rows[(mode, small)]
            print(f"{mode}: {large} ops / {small} ops = {ratio:.1f}x the time ({large / small:.0f}x the ops)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suggest", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    args = parser.parse_args(argv)
    return bench_main(lambda: run(args.sizes))


if __name__ == "__main__":
    raise SystemExit(main())
