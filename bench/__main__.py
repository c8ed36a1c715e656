"""``python -m bench``: coremltools' passes, coremltools' generic infrastructure, ours and the rewrite floor.

Prints one table of every chain workload (times of (a) (b) (c) (d), ratios a/c, b/c, c/d), the
matching-cost-versus-K table, the 24-layer transformer conversion, and each target as PASS or FAIL.
Writes ``<out>/results.json`` and ``<out>/scaling.png``.

Usage::

    python -m bench              # full run (about 10 minutes)
    python -m bench --quick      # small N only: a smoke run
    python -m bench --profile 800  # cProfile of our GELU pass on a chain of 800
    python -m bench --profile 100 --workload layernorm

Deterministic counts instead of times (under valgrind): ``python -m bench.instructions gelu 100``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' progress bars would bury the table

import argparse
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

logger = logging.getLogger("bench")

FULL = {
    "gelu": (25, 50, 100, 200, 400, 800, 1000, 2000),
    "layernorm": (25, 50, 100, 200, 400),
    "conv_bn": (25, 50, 100, 200, 400),
    "k_n": 200,
    "k_repeats": 5,
    "layers": 24,
    "convert_repeats": 2,
}
QUICK = {
    "gelu": (25, 50, 100),
    "layernorm": (25, 50),
    "conv_bn": (25, 50),
    "k_n": 50,
    "k_repeats": 3,
    "layers": 2,
    "convert_repeats": 1,
}
K_VALUES = (0, 10, 50)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small N only (smoke run, about a minute)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "out",
        help="output directory (default: bench/out)",
    )
    parser.add_argument("--no-convert", action="store_true", help="skip the transformer conversion")
    parser.add_argument(
        "--layers", type=int, default=None, help="transformer layers (default 24; 2 with --quick)"
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="N",
        default=None,
        help="only profile our pass on a chain of N and print where the time goes",
    )
    parser.add_argument(
        "--workload",
        choices=("gelu", "layernorm", "conv_bn"),
        default="gelu",
        help="chain to profile with --profile (default gelu)",
    )
    return parser.parse_args(argv)


def _banner(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _run(args: argparse.Namespace) -> int:
    from .report import (
        chain_table,
        evaluate_targets,
        k_table,
        plot_scaling,
        transformer_table,
        write_json,
    )
    from .suites import run_chain, run_k_independence, run_transformer

    if args.profile is not None:
        from .profiling import profile_ours

        print(profile_ours(args.workload, args.profile))
        return 0

    import coremltools

    try:
        import generic_passes  # noqa: F401  registers our passes; everything below needs them
    except Exception as exc:  # a pass module broken mid-edit: nothing of ours can be measured
        print(f"cannot import generic_passes ({type(exc).__name__}: {exc}); fix it and rerun `make bench`")
        return 2

    config = QUICK if args.quick else FULL
    started = time.perf_counter()
    load_start = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    skipped: dict[str, str] = {}
    for workload in ("gelu", "layernorm", "conv_bn"):
        _banner(f"{workload} chains, N = {list(config[workload])}")
        found, note = run_chain(workload, config[workload], progress=lambda line: print(line, flush=True))
        rows.extend(found)
        if note:
            skipped[workload] = note
            print(f"  {note}")
        if workload == "gelu":
            _banner(
                f"matching cost vs K dummy sub-passes (GELU chain N={config['k_n']}, K = {list(K_VALUES)})"
            )
            k_results = run_k_independence(config["k_n"], K_VALUES, config["k_repeats"])
            print(k_table(k_results), flush=True)

    transformer: dict[str, Any] | None = None
    if not args.no_convert:
        layers = args.layers or config["layers"]
        _banner(f"coremltools.convert of a {layers}-layer pre-norm transformer, override off and on")
        transformer = run_transformer(
            layers, config["convert_repeats"], progress=lambda s: print(s, flush=True)
        )

    targets = evaluate_targets(rows, k_results, transformer, args.quick)
    elapsed = time.perf_counter() - started

    _banner("results: chains (best of repeats; '(1 run)' = single timed run)")
    print(chain_table(rows, skipped))
    print(
        "(a) coremltools' pass class, override off; (b) coremltools' generic_pass_infrastructure."
        "fuse_all_blocks with its own patterns; (c) ours, override on; (d) rewrite only, matches known."
    )
    _banner("results: matching cost vs unrelated sub-passes")
    print(k_table(k_results))
    if transformer is not None:
        _banner("results: transformer conversion")
        print(transformer_table(transformer))
    _banner("targets")
    print("  (status on wall time, time.perf_counter; 'CPU:' = the same rule on the thread's CPU time)")
    for target in targets:
        cpu = f" (CPU: {target.cpu_status})" if target.cpu_status else ""
        print(f"  [{target.status}]{cpu} {target.name}\n           {target.detail}")
    contention = _contention(rows)
    if contention:
        print(f"\n  note: {contention}")

    meta = {
        "mode": "quick" if args.quick else "full",
        "python": platform.python_version(),
        "coremltools": coremltools.__version__,
        "torch": sys.modules["torch"].__version__ if "torch" in sys.modules else None,
        "cpus": os.cpu_count(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "wall_seconds": elapsed,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_json(args.out / "results.json", meta, rows, skipped, k_results, transformer, targets)
    note = (
        f"{meta['mode']} run, {meta['cpus']} CPUs, load avg {load_start[0]:.1f}; "
        f"coremltools {meta['coremltools']}"
    )
    plot_scaling(args.out / "scaling.png", rows, note)
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'scaling.png'} ({elapsed:.0f}s in all)")
    return 0


def _contention(rows: list[Any]) -> str:
    """A warning when wall time was much longer than CPU time: other processes shared the CPUs."""
    pairs = [
        (t.seconds, t.cpu_seconds)
        for r in rows
        for t in r.timings.values()
        if t.seconds is not None and t.cpu_seconds and t.seconds > 0.05
    ]
    if not pairs:
        return ""
    ratio = sum(w for w, _ in pairs) / sum(c for _, c in pairs)
    if ratio < 1.3:
        return ""
    return (
        f"wall time was {ratio:.1f}x the benchmark thread's CPU time on average (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): the machine was shared, so wall-time ratios "
        f"are noisy; the CPU-time verdicts are the steadier ones."
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark in a thread with a deep stack: ``copy.deepcopy`` of a long chain recurses deeply.

    Returns:
        The process exit code (0 unless the benchmark itself crashed; missed targets do not abort).
    """
    args = _parse(argv)
    from .workloads import bench_main

    return bench_main(lambda: _run(args))


if __name__ == "__main__":
    raise SystemExit(main())
