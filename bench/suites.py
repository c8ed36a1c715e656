"""The measurements: chains of N patterns, matching cost against unrelated passes, a full conversion.

* :func:`run_chain` times the four runners of :mod:`bench.runners` on chains of growing N, checks that
  every runner produced the same program, and skips coremltools' runners once they are too slow
  (they grow quadratically: a runner is skipped at N when it took more than ``SKIP_AFTER_SECONDS`` at
  the previous N, or its predicted time exceeds ``SKIP_PREDICTED_SECONDS``).
* :func:`run_k_independence` registers K dummy sub-passes for op types the program does not hold, in one
  ``PassContainer`` of the ``bench`` namespace alongside the GELU patterns, and shows that the GELU
  sub-passes' time and ``bind_attempts`` do not depend on K.
* :func:`run_transformer` converts a pre-norm transformer with ``coremltools.convert``, with the override
  off and on, and reports both times and op counts.
"""

from __future__ import annotations

import copy
import gc
import io
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra import (
    ConstRule,
    PassContainer,
    PassStats,
    Pattern,
    SubPass,
    register_generic_pass,
    run_log,
)

from .runners import (
    RUNNER_KEYS,
    Runner,
    Timing,
    name_counter_state,
    op_type_counts,
    override,
    time_runner,
    workload_runners,
)
from .workloads import conv_bn_chain, gelu_chain, layernorm_chain, transformer_model

__all__ = [
    "CHAINS",
    "ChainRow",
    "SKIP_AFTER_SECONDS",
    "SKIP_PREDICTED_SECONDS",
    "run_chain",
    "run_k_independence",
    "run_transformer",
]

logger = logging.getLogger(__name__)

SKIP_AFTER_SECONDS = 20.0
"""A coremltools runner is skipped at N once it took longer than this at the previous N."""

SKIP_PREDICTED_SECONDS = 45.0
"""... or once its extrapolated time at N exceeds this."""

CHAINS: dict[str, tuple[Callable[[int], Program], str]] = {
    "gelu": (gelu_chain, "gelu"),
    "layernorm": (layernorm_chain, "layer_norm"),
    "conv_bn": (conv_bn_chain, "conv"),
}
"""Workload name to (program builder, op type each copy of the pattern becomes)."""


@dataclass
class ChainRow:
    """One workload at one N."""

    workload: str
    """``gelu``, ``layernorm`` or ``conv_bn``."""
    n: int
    """Copies of the pattern in the chain."""
    ops: int
    """Non-const ops of the program before the rewrite."""
    timings: dict[str, Timing] = field(default_factory=dict)
    """Per runner key."""
    problems: list[str] = field(default_factory=list)
    """Result checks that failed; a runner named here has a void time."""
    void: set[str] = field(default_factory=set)
    """Runner keys whose result was wrong."""
    ours_stats: dict[str, float] = field(default_factory=dict)
    """Matcher counters of ours, per run: attempts, bind_attempts, rewrites, iterations."""
    same_text: dict[str, bool] = field(default_factory=dict)
    """``str(prog)`` equality with (a)'s result, per runner key, where both ran."""

    def seconds(self, key: str, cpu: bool = False) -> float | None:
        """The runner's best wall (or CPU) time, None if it did not run or its result was wrong."""
        timing = self.timings.get(key)
        if timing is None or key in self.void:
            return None
        return timing.cpu_seconds if cpu else timing.seconds


def _max_repeats(n: int) -> int:
    return 5 if n <= 100 else 3 if n <= 400 else 2


def _paired_repeats(n: int) -> int:
    """Rounds of (c) then (d): they are the ratio the 1.75x target is about, and this machine's speed
    drifts by +-10% over seconds, so they alternate run by run and get more rounds than (a) and (b)."""
    return 7 if n <= 400 else 5 if n <= 1000 else 4


def _best_of(timings: list[Timing]) -> Timing:
    """One timing from single runs: best wall and best CPU time, every run kept, the last program."""
    done = [t for t in timings if t.seconds is not None]
    if len(done) < len(timings):
        return next(t for t in timings if t.seconds is None)  # a failed run: its note
    best = Timing(repeats=len(done), program=done[-1].program)
    best.all_seconds = [s for t in done for s in t.all_seconds]
    best.seconds = min(best.all_seconds)
    best.cpu_seconds = min(t.cpu_seconds for t in done if t.cpu_seconds is not None)
    return best


def _predict(history: list[tuple[int, float]], n: int) -> tuple[float, float]:
    """Extrapolated seconds at ``n`` and the exponent used (fitted on the last two points, at least 2)."""
    n1, t1 = history[-1]
    exponent = 2.0
    if len(history) >= 2:
        n0, t0 = history[-2]
        if t0 > 0 and n1 > n0 and t1 > 0:
            exponent = min(3.0, max(2.0, math.log(t1 / t0) / math.log(n1 / n0)))
    return t1 * (n / n1) ** exponent, exponent


def _skip_note(history: list[tuple[int, float]], n: int) -> str:
    if not history:
        return ""
    predicted, exponent = _predict(history, n)
    if history[-1][1] <= SKIP_AFTER_SECONDS and predicted <= SKIP_PREDICTED_SECONDS:
        return ""
    growth = "quadratic" if exponent < 2.3 else f"~N^{exponent:.1f}"
    return f"skipped ({growth}: predicted {predicted:.0f}s)"


def _container_stats(runner: Runner) -> PassStats | None:
    container = runner.container
    if container is None:
        return None
    total = PassStats()
    for sub in container.passes:
        if isinstance(sub, SubPass):
            total.add(sub.stats)
    return total


def run_chain(
    workload: str,
    sizes: Sequence[int],
    *,
    progress: Callable[[str], None] = print,
    cell_budget_seconds: float = 4.0,
) -> tuple[list[ChainRow], str]:
    """Times the four runners on chains of each size.

    Args:
        workload: A key of :data:`CHAINS`.
        sizes: The N to measure, increasing.
        progress: Receives a line per finished row.
        cell_budget_seconds: Repeats of (a) or (b) stop after this much timed work; (c) and (d) alternate
            for a fixed number of rounds (``_paired_repeats``).

    Returns:
        The rows, and a non-empty note if the workload was skipped as a whole.
    """
    builder, fused_type = CHAINS[workload]
    found = workload_runners(workload)
    if found.skipped:
        return [], found.skipped
    runners = found.runners
    history: dict[str, list[tuple[int, float]]] = {key: [] for key in RUNNER_KEYS}
    rows: list[ChainRow] = []
    for n in sizes:
        prog = builder(n)
        row = ChainRow(workload, n, sum(op_type_counts(prog).values()))
        names = name_counter_state()
        for key in ("a", "b"):
            runner = runners[key]
            note = _skip_note(history[key], n)
            if note:
                row.timings[key] = Timing(note=note)
                continue
            timing = time_runner(runner, prog, _max_repeats(n), cell_budget_seconds, names)
            row.timings[key] = timing
            if timing.seconds is not None:
                history[key].append((n, timing.seconds))
        before = _stats_snapshot(runners["c"])
        runs: dict[str, list[Timing]] = {"c": [], "d": []}
        for _ in range(_paired_repeats(n)):
            for key in ("c", "d"):
                if runs[key]:
                    runs[key][-1].program = None  # only the last run's program is checked
                runs[key].append(time_runner(runners[key], prog, 1, 0.0, names))
        for key in ("c", "d"):
            row.timings[key] = _best_of(runs[key])
        if row.timings["c"].repeats:
            row.ours_stats = _stats_per_run(before, _stats_snapshot(runners["c"]), row.timings["c"].repeats)
        _check_row(row, fused_type)
        for timing in row.timings.values():
            timing.program = None  # free the copies before the next size
        rows.append(row)
        progress(_progress_line(row))
        gc.collect()
    return rows, ""


def _stats_snapshot(runner: Runner) -> PassStats | None:
    stats = _container_stats(runner)
    return copy.copy(stats) if stats is not None else None


def _stats_per_run(before: PassStats | None, after: PassStats | None, runs: int) -> dict[str, float]:
    if before is None or after is None:
        return {}
    names = ("attempts", "bind_attempts", "matches", "rewrites", "iterations")
    return {name: (getattr(after, name) - getattr(before, name)) / runs for name in names}


def _check_row(row: ChainRow, fused_type: str) -> None:
    """Every runner that ran must give the expected op types; (a) and (c) must print the same program."""
    expected = {fused_type: row.n, "relu": row.n}
    for key, timing in row.timings.items():
        if timing.program is None:
            continue
        counts = dict(sorted(op_type_counts(timing.program).items()))
        if counts != expected:
            row.void.add(key)
            row.problems.append(f"({key}) gave {counts}, expected {expected}")
    reference = row.timings.get("a")
    if reference is not None and reference.program is not None:
        text = str(reference.program)
        for key in ("b", "c", "d"):
            other = row.timings.get(key)
            if other is not None and other.program is not None:
                row.same_text[key] = str(other.program) == text
        if row.same_text.get("c") is False:
            row.void.add("c")
            row.problems.append("str(prog) of (c) differs from (a)")


def _progress_line(row: ChainRow) -> str:
    cells = []
    for key in RUNNER_KEYS:
        seconds = row.seconds(key)
        cells.append(f"{key}={seconds:.4f}s" if seconds is not None else f"{key}=-")
    status = "ok" if not row.problems else "; ".join(row.problems)
    return f"  {row.workload:<9} N={row.n:<5} " + " ".join(cells) + f"  [{status}]"


# ------------------------------------------------------------------------------------------------------
# Matching cost does not depend on how many passes exist for other op types.
# ------------------------------------------------------------------------------------------------------

_ABSENT_UNARY = (
    "sin", "cos", "tan", "exp", "exp2", "sqrt", "abs", "floor", "ceil", "round", "sign", "sigmoid",
    "softplus", "erf", "asin", "acos", "atan", "sinh", "cosh", "atanh", "square", "softsign",
)  # fmt: skip
"""Unary op types no GELU chain holds; the dummy patterns are made of them."""


def _dummy_pattern(i: int) -> Program:
    """Dummy pattern ``i``: two unary ops of types absent from the benchmark programs."""
    first = _ABSENT_UNARY[i % len(_ABSENT_UNARY)]
    second = _ABSENT_UNARY[(i // len(_ABSENT_UNARY) + i + 1) % len(_ABSENT_UNARY)]

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))])
    def pattern(x: Any) -> Any:
        inner = getattr(mb, first)(x=x, name="first")
        return getattr(mb, second)(x=inner, name="second")

    return pattern


def _never(pattern: Pattern) -> bool:
    """Transform of the dummy sub-passes: declines (it is never reached)."""
    return False


def k_container(k: int) -> PassContainer:
    """``bench::gelu_with_<k>_dummies``: K dummy sub-passes, then the two GELU patterns."""
    from generic_passes.fuse_gelu_tanh_approximation import (
        gelu_tanh_pattern_1,
        gelu_tanh_pattern_2,
        transform_gelu_tanh,
    )

    pass_name = f"gelu_with_{k}_dummies"
    existing = PASS_REGISTRY.passes.get(f"bench::{pass_name}")
    if isinstance(existing, PassContainer):
        return existing
    container = None
    for i in range(k):
        container = register_generic_pass(
            _dummy_pattern(i), None, _never, pass_name, "bench", name=f"dummy{i}"
        )
    container = register_generic_pass(
        [gelu_tanh_pattern_1, gelu_tanh_pattern_2],
        None,
        transform_gelu_tanh,
        pass_name,
        "bench",
        constants=ConstRule("value", rtol=0.0, atol=1e-3),
        name="gelu_tanh",
    )
    return container


def run_k_independence(n: int, ks: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Times the GELU patterns on ``gelu_chain(n)`` inside containers with K dummy sub-passes.

    Repeats are interleaved over K so that drift in machine load hits every K alike.

    Returns:
        Per K: best whole-pass time (wall and CPU), best time of the GELU sub-passes alone, and per-run
        counters of the GELU sub-passes and of the dummies.
    """
    prog = gelu_chain(n)
    containers = {k: k_container(k) for k in ks}
    results: dict[int, dict[str, Any]] = {
        k: {"k": k, "seconds": [], "cpu_seconds": [], "gelu_seconds": [], "ok": True} for k in ks
    }
    for _ in range(repeats):
        for k in ks:
            container = containers[k]
            gelu_subs = [s for s in container.passes if isinstance(s, SubPass) and s.name.startswith("gelu")]
            dummy_subs = [
                s for s in container.passes if isinstance(s, SubPass) and s.name.startswith("dummy")
            ]
            work = copy.deepcopy(prog)
            before = [copy.copy(s.stats) for s in gelu_subs + dummy_subs]
            gc.collect()
            cpu_start = time.thread_time()
            start = time.perf_counter()
            with override(True):
                container(work)
            elapsed = time.perf_counter() - start
            results[k]["cpu_seconds"].append(time.thread_time() - cpu_start)
            after = [s.stats for s in gelu_subs + dummy_subs]
            diffs = [a - b for b, a in zip(before, after)]
            gelu_diff, dummy_diff = diffs[: len(gelu_subs)], diffs[len(gelu_subs) :]
            entry = results[k]
            entry["seconds"].append(elapsed)
            entry["gelu_seconds"].append(sum(d.seconds for d in gelu_diff))
            entry["gelu_bind_attempts"] = sum(d.bind_attempts for d in gelu_diff)
            entry["gelu_attempts"] = sum(d.attempts for d in gelu_diff)
            entry["gelu_rewrites"] = sum(d.rewrites for d in gelu_diff)
            entry["dummy_bind_attempts"] = sum(d.bind_attempts for d in dummy_diff)
            entry["sub_passes"] = len(container.passes)
            counts = dict(op_type_counts(work))
            if counts != {"gelu": n, "relu": n}:
                entry["ok"] = False
                entry["problem"] = f"gave {counts}"
    out = []
    for k in ks:
        entry = results[k]
        entry["best_seconds"] = min(entry["seconds"])
        entry["best_cpu_seconds"] = min(entry["cpu_seconds"])
        entry["best_gelu_seconds"] = min(entry["gelu_seconds"])
        entry["n"] = n
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------------
# A whole coremltools.convert, override off and on.
# ------------------------------------------------------------------------------------------------------


def _count_non_const(prog: Program) -> int:
    return sum(op_type_counts(prog).values())


CLOSE_CALL = 0.10
"""Another off/on pair of conversions is done only while the best times differ by less than this."""


def _close(result: dict[str, Any], margin: float) -> bool:
    off, on = min(result["off"]["seconds"]), min(result["on"]["seconds"])
    return abs(on - off) < margin * off


def run_transformer(n_layers: int, repeats: int, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Exports a pre-norm transformer once and converts it with the override off and on.

    Conversions alternate off, on, off, on... after an untimed warm-up conversion of a one-layer model
    both ways (first-conversion costs would otherwise land on whichever runs first). Up to ``repeats``
    pairs are done, a further pair only while the two best times are within ``CLOSE_CALL`` of each other.

    Returns:
        Times (best and all), op counts, op types, which generic passes rewrote, and export time.
    """
    import coremltools as ct
    import torch

    import generic_passes  # noqa: F401  registers the project's passes

    def export(module: Any, args: Any) -> Any:
        with redirect_stderr(io.StringIO()):
            return torch.export.export(module.eval(), args).run_decompositions({})

    def convert(program: Any, enabled: bool) -> tuple[float, float, Program]:
        gc.collect()
        with override(enabled), redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
            cpu_start = time.thread_time()
            start = time.perf_counter()
            model = ct.convert(
                program,
                convert_to="mlprogram",
                skip_model_load=True,
                compute_precision=ct.precision.FLOAT32,
                minimum_deployment_target=ct.target.iOS17,
            )
            elapsed = time.perf_counter() - start
            cpu = time.thread_time() - cpu_start
        return elapsed, cpu, model._mil_program

    warm_module, warm_args, _ = transformer_model(1)
    warm = export(warm_module, warm_args)
    convert(warm, False)
    convert(warm, True)

    module, args, source = transformer_model(n_layers)
    start = time.perf_counter()
    exported = export(module, args)
    export_seconds = time.perf_counter() - start
    progress(f"  transformer: exported {n_layers} layers in {export_seconds:.1f}s ({source})")
    result: dict[str, Any] = {
        "n_layers": n_layers,
        "model": source,
        "export_seconds": export_seconds,
        "off": {"seconds": [], "cpu_seconds": [], "ops": []},
        "on": {"seconds": [], "cpu_seconds": [], "ops": []},
    }
    for attempt in range(repeats):
        if attempt and not _close(result, CLOSE_CALL):
            break  # one pair already decides: no need for another 2 conversions
        for label, enabled in (("off", False), ("on", True)):
            run_log(clear=True)
            seconds, cpu, prog = convert(exported, enabled)
            side = result[label]
            side["seconds"].append(seconds)
            side["cpu_seconds"].append(cpu)
            side["ops"].append(_count_non_const(prog))
            side["op_types"] = dict(sorted(op_type_counts(prog).items()))
            if enabled:
                fired: dict[str, int] = {}
                for pass_id, generic, stats in run_log(clear=True):
                    if generic and stats.rewrites:
                        fired[pass_id] = fired.get(pass_id, 0) + stats.rewrites
                side["generic_rewrites"] = dict(sorted(fired.items()))
            progress(f"  transformer: override {label:<3} {seconds:6.1f}s  {side['ops'][-1]} ops")
    for label in ("off", "on"):
        side = result[label]
        side["best_seconds"] = min(side["seconds"])
        side["stable_ops"] = len(set(side["ops"])) == 1
    result["override_env"] = os.environ.get("ENABLE_EXPERIMENTAL_PASSES")
    return result
