"""``python -m bench.llm``: the whole ``coremltools.convert`` at LLM size, three ways side by side.

For each workload (a 32-layer Llama-style decoder written out, and the synthetic mix at 10k, 25k, 50k
and 100k ops; see :mod:`bench.llm_workloads`), one process converts a freshly built MIL program with
``coremltools.convert(prog, convert_to="mlprogram", skip_model_load=True)``:

* ``off``: coremltools' default pipeline, ``ENABLE_EXPERIMENTAL_PASSES`` unset (coremltools' passes);
* ``on``: the same pipeline with the override on, pass by pass, our fusion passes only: the
  replacements of coremltools' cleanup passes (``generic_passes.CLEANUP_PASSES``, e.g.
  ``common::topological_reorder``) are taken out for this column
  (``generic_passes.coremltools_cleanup()``), so it stays the baseline it was before they existed
  ("today's path" of issue 17);
* ``on+``: the override on, pass by pass, with those replacements (every generic pass);
* ``ours``: ``pass_pipeline=pattern_infra.pipeline()`` with every generic pass, replacements included
  (each run of passes one sweep).

Every pipeline entry is timed (a wrapper around each ``PASS_REGISTRY`` entry, summed per pass id over
the frontend, main and backend pipelines; a generic pass's ``run_after`` followers count in their
leader; inside a sweep of ``pipeline()``, coremltools' passes are timed on their own as well, so a
sweep's time includes theirs), and so are coremltools' whole-program validations (``Program.validate``)
and the formatting of the whole program (``Program.__str__``: ``apply_pipeline`` formats it twice per
pipeline for a debug message even when debug logging is off). ``on``, ``on+`` and ``ours`` must give
the same program; ``off`` is skipped at a size where its time, extrapolated from the smaller sizes,
would exceed ``--off-budget``.

Times are CPU times of the converting thread (the machine may be shared), the whole conversion's wall
time beside them. Each pass's growth exponent is the slope of log(time) against log(ops) over the mix
sizes. Writes ``<out>/llm.json`` and the plot (default ``docs/llm_scaling.png``).

Usage::

    python -m bench.llm                      # full run (about an hour on a quiet 2-core machine)
    python -m bench.llm --quick              # 1k and 2k ops, 2 layers: a smoke run
    python -m bench.llm --sizes 10000 25000  # chosen mix sizes
    python -m bench.llm --no-llama --sizes 100000 --merge bench/out/earlier.json  # add a size to a run
    python -m bench.llm --sizes 100000 --modes on ours                          # only these columns
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' progress bars would bury the table

import argparse
import gc
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Conversion", "convert_timed", "growth_exponent", "load_rows", "main", "timed_passes"]

logger = logging.getLogger("bench.llm")

MODES = ("off", "on", "on+", "ours")
FULL_SIZES = (10_000, 25_000, 50_000, 100_000)
QUICK_SIZES = (1_000, 2_000)
_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Conversion:
    """One timed ``coremltools.convert``."""

    workload: str
    ops: int
    """Non-const ops of the program before conversion."""
    mode: str
    seconds: float
    """Wall time of the whole ``convert``."""
    cpu_seconds: float | None = None
    """CPU time of the converting thread (steadier than wall time when the machine is shared)."""
    passes: dict[str, float] = field(default_factory=dict)
    """CPU seconds per pass id (summed over its entries in every pipeline)."""
    validate_seconds: float = 0.0
    """CPU time in ``Program.validate``."""
    validations: int = 0
    format_seconds: float = 0.0
    """CPU time formatting the whole program (``Program.__str__``)."""
    formats: int = 0
    ops_after: int = 0
    """Non-const ops of the converted program."""
    same_as_on: bool | None = None
    """For ``on+`` and ``ours``: whether the converted program has the signature of ``on``'s."""


class _Timed:
    """Stands in a ``PASS_REGISTRY`` entry: resolves it as the registry would and times the call."""

    def __init__(self, pass_id: str, entry: Any, totals: dict[str, float]) -> None:
        self.pass_id, self.entry, self.totals = pass_id, entry, totals
        self.instance: Any = None

    def set_options(self, options: Any = None) -> None:
        self.instance = self.entry() if isinstance(self.entry, type) else self.entry
        self.instance.set_options(options)

    def __call__(self, prog: Any) -> None:
        instance = (
            self.instance
            if self.instance is not None
            else (self.entry() if isinstance(self.entry, type) else self.entry)
        )
        self.instance = None
        start = time.thread_time()
        try:
            instance(prog)
        finally:
            self.totals[self.pass_id] += time.thread_time() - start

    def __str__(self) -> str:
        return str(self.entry if not isinstance(self.entry, type) else self.entry.__name__)


@contextmanager
def timed_passes(result: Conversion) -> Iterator[None]:
    """Times every registered pass, ``Program.validate`` and ``Program.__str__`` into ``result``."""
    from coremltools.converters.mil.mil import Program
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    totals: dict[str, float] = defaultdict(float)
    saved = dict(PASS_REGISTRY.passes)
    original_validate, original_str = Program.validate, Program.__str__

    def validate(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return original_validate(self, *args, **kwargs)
        finally:
            result.validate_seconds += time.thread_time() - start
            result.validations += 1

    def to_str(self: Any, *args: Any, **kwargs: Any) -> str:
        start = time.thread_time()
        try:
            return original_str(self, *args, **kwargs)
        finally:
            result.format_seconds += time.thread_time() - start
            result.formats += 1

    PASS_REGISTRY.passes.update({k: _Timed(k, v, totals) for k, v in saved.items()})
    Program.validate, Program.__str__ = validate, to_str
    try:
        yield
    finally:
        PASS_REGISTRY.passes.clear()
        PASS_REGISTRY.passes.update(saved)
        Program.validate, Program.__str__ = original_validate, original_str
        result.passes = dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def _non_const_ops(prog: Any) -> int:
    from pattern_infra.rewriting.blocks import walk_blocks

    return sum(1 for _, ops in walk_blocks(prog) for op in ops if op.op_type != "const")


def convert_timed(workload: str, build: Callable[[], Any], mode: str) -> tuple[Conversion, Any]:
    """Builds a fresh program and converts it in ``mode``; returns the timing and the MIL program."""
    import generic_passes
    import pattern_infra
    from pattern_infra.testing.pipelines import converted

    prog = build()
    result = Conversion(workload, _non_const_ops(prog), mode, 0.0)
    pipeline = pattern_infra.pipeline() if mode == "ours" else None  # built before the timing wrappers
    gc.collect()
    # "on": today's path, coremltools' cleanup passes where generic_passes replaces them (entered
    # before the timing wrappers, which then wrap coremltools' passes)
    baseline = generic_passes.coremltools_cleanup() if mode == "on" else nullcontext()
    with baseline, timed_passes(result):
        start, cpu_start = time.perf_counter(), time.thread_time()
        out = converted(lambda: prog, (lambda: pipeline) if pipeline else None, override=mode != "off")
        result.seconds = time.perf_counter() - start
        result.cpu_seconds = time.thread_time() - cpu_start
    result.ops_after = _non_const_ops(out)
    return result, out


def growth_exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(seconds) against log(ops); None with fewer than two usable points."""
    pts = [(math.log(n), math.log(s)) for n, s in points if s > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return None if var == 0 else sum((x - mx) * (y - my) for x, y in pts) / var


def _predicted(history: list[tuple[int, float]], ops: int) -> float | None:
    """Time at ``ops`` extrapolated from the measured sizes (quadratic from one point)."""
    if not history:
        return None
    exponent = growth_exponent(history) if len(history) > 1 else 2.0
    n, s = history[-1]
    return s * (ops / n) ** max(exponent or 2.0, 1.0)


def _run_workload(
    name: str,
    build: Callable[[], Any],
    off_history: list[tuple[int, float]],
    off_budget: float,
    ops_hint: int,
    modes: tuple[str, ...] = MODES,
) -> list[Conversion]:
    from pattern_infra.testing.pipelines import program_signature

    rows: list[Conversion] = []
    signatures: dict[str, Any] = {}
    for mode in [m for m in ("on", "on+", "ours", "off") if m in modes]:
        if mode == "off":
            guess = _predicted(off_history, ops_hint)
            if guess is not None and guess > off_budget:
                print(
                    f"  {name}: off skipped (predicted {guess:.0f} s > --off-budget {off_budget:.0f} s)",
                    flush=True,
                )
                continue
        row, out = convert_timed(name, build, mode)
        if mode != "off":
            signatures[mode] = program_signature(out)
        if mode in ("on+", "ours") and "on" in signatures:
            row.same_as_on = signatures[mode] == signatures["on"]
        del out
        rows.append(row)
        print(
            f"  {name} ({row.ops} ops) {mode:>4}: {row.seconds:7.1f} s (CPU {row.cpu_seconds:7.1f} s)  "
            f"validate {row.validate_seconds:6.1f} s ({row.validations}x)  format {row.format_seconds:5.1f} "
            f"s ({row.formats}x)  -> {row.ops_after} ops"
            + ("" if row.same_as_on is None else f"  same program as on: {row.same_as_on}"),
            flush=True,
        )
        if mode == "off":
            off_history.append((row.ops, row.seconds))
    return rows


def _table(rows: list[Conversion]) -> str:
    by = {(r.workload, r.mode): r for r in rows}
    names = list(dict.fromkeys(r.workload for r in rows))
    lines = [
        "| workload | ops | off | on (pass by pass) | on+ (with replacements) | ours (pipeline()) "
        "| on/ours CPU | off/ours CPU | on/on+ CPU | on/ours wall | validations on / ours | same program |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name in names:
        on, plus, ours, off = (by.get((name, m)) for m in ("on", "on+", "ours", "off"))
        ref = on or ours or plus
        same = [r.same_as_on for r in (plus, ours) if r is not None and r.same_as_on is not None]
        lines.append(
            f"| {name} | {ref.ops if ref else '?'} | {_cell(off, 'skipped')} | {_cell(on)} | {_cell(plus)} "
            f"| {_cell(ours)} | {_cpu_ratio(on, ours)} | {_cpu_ratio(off, ours)} | {_cpu_ratio(on, plus)} "
            f"| {f'{on.seconds / ours.seconds:.2f}x' if on and ours else '-'} "
            f"| {f'{on.validations} / {ours.validations}' if on and ours else '-'} "
            f"| {all(same) if same else '-'} |"
        )
    return "\n".join(lines)


def _cell(row: Conversion | None, missing: str = "-") -> str:
    """CPU seconds (wall beside them), or ``missing``."""
    if row is None:
        return missing
    return (
        f"{row.cpu_seconds:.1f} s ({row.seconds:.0f} s wall)"
        if row.cpu_seconds
        else f"{row.seconds:.1f} s wall"
    )


def _cpu_ratio(a: Conversion | None, b: Conversion | None) -> str:
    if a is None or b is None or not a.cpu_seconds or not b.cpu_seconds:
        return "-"
    return f"{a.cpu_seconds / b.cpu_seconds:.2f}x"


def _total(row: Conversion) -> float:
    """The conversion's CPU time where measured, else its wall time."""
    return row.cpu_seconds or row.seconds


def _pass_table(rows: list[Conversion], mode: str, top: int = 12) -> str:
    mix = sorted((r for r in rows if r.mode == mode and r.workload.startswith("mix")), key=lambda r: r.ops)
    if not mix:
        return ""
    totals: dict[str, float] = defaultdict(float)
    for r in mix:
        for k, v in r.passes.items():
            totals[k] += v
    keys = sorted(totals, key=lambda k: -totals[k])[:top]
    extra = [
        ("(validate)", lambda r: r.validate_seconds),
        ("(format program)", lambda r: r.format_seconds),
        ("(whole convert, CPU)", _total),
    ]
    lines = [
        f"| {mode}: pass | " + " | ".join(f"{r.ops} ops" for r in mix) + " | exponent |",
        "|---|" + "---:|" * (len(mix) + 1),
    ]
    getters = [(k, (lambda r, k=k: r.passes.get(k, 0.0))) for k in keys] + extra
    for label, get in getters:
        exponent = growth_exponent([(r.ops, get(r)) for r in mix])
        cells = " | ".join(f"{get(r):.2f}" for r in mix)
        lines.append(f"| {label} | {cells} | {'-' if exponent is None else f'{exponent:.2f}'} |")
    return "\n".join(lines)


def plot(path: Path, rows: list[Conversion], note: str) -> None:
    """Whole conversion time against ops per mode, and the costliest passes with the override on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mix = [r for r in rows if r.workload.startswith("mix")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for mode, style in zip(MODES, ("s--", "o-", "v:", "^-")):
        pts = sorted((r.ops, _total(r)) for r in mix if r.mode == mode)
        if pts:
            exponent = growth_exponent(pts)
            label = f"{mode} (exponent {exponent:.2f})" if exponent is not None else mode
            left.plot(*zip(*pts), style, label=label)
    left.set(
        xscale="log",
        yscale="log",
        xlabel="non-const ops",
        ylabel="CPU seconds",
        title="whole coremltools.convert, synthetic mix",
    )
    left.legend()
    on = sorted((r for r in mix if r.mode == "on"), key=lambda r: r.ops)
    if on:
        totals: dict[str, float] = defaultdict(float)
        for r in on:
            for k, v in r.passes.items():
                totals[k] += v
        series = [
            (k, lambda r, k=k: r.passes.get(k, 0.0)) for k in sorted(totals, key=lambda k: -totals[k])[:7]
        ]
        series.append(("(validate)", lambda r: r.validate_seconds))
        series.append(("(format program)", lambda r: r.format_seconds))
        for label, get in series:
            right.plot([r.ops for r in on], [max(get(r), 1e-3) for r in on], ".-", label=label)
        right.set(
            xscale="log",
            yscale="log",
            xlabel="non-const ops",
            ylabel="CPU seconds",
            title="costliest passes, override on, pass by pass",
        )
        right.legend(fontsize=7)
    fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_rows(path: Path) -> list[Conversion]:
    """The conversions an earlier run wrote to ``path`` (its ``llm.json``)."""
    return [Conversion(**row) for row in json.loads(path.read_text())["rows"]]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.llm", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1k and 2k ops and a 2-layer decoder (smoke run)"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="mix sizes in non-const ops")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 32; 2 with --quick)"
    )
    parser.add_argument("--no-llama", action="store_true", help="skip the decoder")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="columns to run (default all; 'off' is still skipped past --off-budget)",
    )
    parser.add_argument(
        "--off-budget",
        type=float,
        default=900.0,
        help="skip 'off' where its predicted time exceeds this many seconds (default 900)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="llm.json files of earlier runs whose rows join the tables and the plot",
    )
    parser.add_argument("--out", type=Path, default=_ROOT / "bench" / "out", help="directory of llm.json")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="plot path (default docs/llm_scaling.png; <out>/llm_scaling.png with --quick)",
    )
    return parser.parse_args(argv)


def _run(args: argparse.Namespace) -> int:
    import coremltools

    import generic_passes  # noqa: F401  registers our passes

    from .llm_workloads import llama_decoder, synthetic_mix

    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    layers = args.layers or (2 if args.quick else 32)
    started, load = time.perf_counter(), os.getloadavg()
    rows: list[Conversion] = [row for path in args.merge for row in load_rows(path)]
    json_path = args.out / "llm.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def keep(found: list[Conversion]) -> None:  # written after each workload: a long run keeps what it did
        rows.extend(found)
        json_path.write_text(json.dumps({"note": "partial", "rows": [asdict(r) for r in rows]}, indent=1))

    if not args.no_llama:
        print(f"== Llama-style decoder, {layers} layers", flush=True)
        keep(
            _run_workload(
                f"llama{layers}", lambda: llama_decoder(layers), [], args.off_budget, 0, tuple(args.modes)
            )
        )
    off_history = sorted((r.ops, r.seconds) for r in rows if r.mode == "off" and r.workload.startswith("mix"))
    for size in sizes:
        print(f"== synthetic mix, {size} ops", flush=True)
        keep(
            _run_workload(
                f"mix{size}",
                lambda size=size: synthetic_mix(size),
                off_history,
                args.off_budget,
                size,
                tuple(args.modes),
            )
        )
    print("\n" + _table(rows))
    for mode in MODES:
        table = _pass_table(rows, mode)
        if table:
            print("\n" + table)
    elapsed = time.perf_counter() - started
    note = (
        f"{'quick' if args.quick else 'full'} run, {os.cpu_count()} CPUs, load avg {load[0]:.1f}, "
        f"coremltools {coremltools.__version__}, {elapsed:.0f} s"
    )
    json_path.write_text(json.dumps({"note": note, "rows": [asdict(r) for r in rows]}, indent=1))
    target = args.plot or (args.out / "llm_scaling.png" if args.quick else _ROOT / "docs" / "llm_scaling.png")
    plot(target, rows, note)
    print(f"\nwrote {json_path} and {target} ({note})")
    return 0 if all(r.same_as_on is not False for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (in a deep-stack thread, like ``python -m bench``).

    Returns:
        0, or 1 when the pipeline gave a different program from the pass-by-pass one somewhere.
    """
    args = _parse(argv)
    from .workloads import bench_main

    return bench_main(lambda: _run(args))


if __name__ == "__main__":
    raise SystemExit(main())
