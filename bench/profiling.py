"""cProfile of our pass (c) on a chain: where the time goes, by phase of the driver and by function.

The phases are inclusive (cumulative) times of the functions that make up one run of a generic pass;
they do not overlap, except "constant checks", which is part of "matching".
"""

from __future__ import annotations

import copy
import cProfile
import gc
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

from coremltools.converters.mil.mil import Block

from pattern_infra import ConstRule, SubPass
from pattern_infra.matching.matcher import Matcher
from pattern_infra.rewriting import blocks, changes, removal
from pattern_infra.rewriting.journal import Journal

from .runners import workload_runners

__all__ = ["profile_ours"]


def _key(function: Callable[..., Any]) -> tuple[str, int, str]:
    code = function.__code__
    return code.co_filename, code.co_firstlineno, code.co_name


def _phases(subs: list[SubPass]) -> list[tuple[str, list[tuple[str, int, str]]]]:
    transforms = list({_key(s.transform_pattern): None for s in subs})
    constraints = list({_key(s.var_constraints): None for s in subs if s.var_constraints is not None})
    return [
        ("matching: Matcher.match_at", [_key(Matcher.match_at)]),
        ("  of which constant checks: ConstRule.accepts (np.allclose)", [_key(ConstRule.accepts)]),
        ("var_constraints callbacks", constraints),
        ("transform callbacks (build replacement, redirect uses)", transforms),
        ("dead matched ops unlinked, per match: remove_dead", [_key(removal.remove_dead)]),
        (
            "undo journal: opening, names of each match, unlinked ops (hooks not counted)",
            [_key(Journal.__init__), _key(Journal.keep_match), _key(Journal.unlinked)],
        ),
        ("validation of each rewrite's changes: validate_rewrite", [_key(changes.validate_rewrite)]),
        ("Block.__exit__ (propagate_nonreplaceable_vars over the whole block)", [_key(Block.__exit__)]),
        (
            "revisit: revisit_candidates (changed ops of the pattern's types, and their neighbourhood)",
            [_key(changes.revisit_candidates)],
        ),
        ("indexing: BlockIndex.__init__", [_key(blocks.BlockIndex.__init__)]),
    ]


def _gc_cost(call: Callable[[], Any]) -> tuple[float, float, dict[int, str]]:
    """Runs ``call``; returns its CPU time, the CPU time spent in cyclic GC collections, and per
    generation the number of collections and their time."""
    spent = [0.0, 0.0]
    counts: dict[int, int] = {}
    seconds: dict[int, float] = {}

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            spent[1] = time.thread_time()
        else:
            elapsed = time.thread_time() - spent[1]
            spent[0] += elapsed
            generation = info["generation"]
            counts[generation] = counts.get(generation, 0) + 1
            seconds[generation] = seconds.get(generation, 0.0) + elapsed

    gc.collect()
    gc.callbacks.append(callback)
    try:
        start = time.thread_time()
        call()
        total = time.thread_time() - start
    finally:
        gc.callbacks.remove(callback)
    return total, spent[0], {g: f"{counts[g]} in {seconds[g]:.3f}s" for g in sorted(counts)}


def profile_ours(workload: str, n: int, top: int = 25) -> str:
    """Profiles one run of ours (c) on the ``workload`` chain of ``n`` (after an untimed warm-up run).

    Args:
        workload: ``gelu``, ``layernorm`` or ``conv_bn``.
        n: Chain length.
        top: Functions listed per ordering.

    Returns:
        The report: unprofiled CPU times of ours and of the floor, time per phase of the driver, and
        the top functions by cumulative and by self time.
    """
    from .suites import CHAINS

    found = workload_runners(workload)
    if found.skipped:
        return found.skipped
    ours, floor = found.runners["c"], found.runners["d"]
    if ours.prepare is None or floor.prepare is None or ours.container is None:
        return f"{workload}: ours or the floor cannot run ({ours.unavailable or floor.unavailable})"
    prog = CHAINS[workload][0](n)
    ours.prepare(copy.deepcopy(prog))()  # warm-up
    plain: list[float] = []
    for runner in (ours, floor):
        best = float("inf")
        for _ in range(3):
            work = copy.deepcopy(prog)
            call = runner.prepare(work)  # type: ignore[misc]
            gc.collect()
            start = time.thread_time()
            call()
            best = min(best, time.thread_time() - start)
        plain.append(best)
    gc_lines = []
    for label, runner in (("ours", ours), ("floor", floor)):
        total, in_gc, counts = _gc_cost(runner.prepare(copy.deepcopy(prog)))  # type: ignore[misc]
        gc_lines.append(
            f"  {label}: {total:.3f}s CPU, of which {in_gc:.3f}s ({in_gc / total:.0%}) in cyclic GC "
            f"collections (by generation: {counts})\n"
        )
    work = copy.deepcopy(prog)
    call = ours.prepare(work)
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries: dict[tuple[str, int, str], Any] = stats.stats  # type: ignore[attr-defined]
    total = max(entry[3] for entry in entries.values())
    out = io.StringIO()
    out.write(
        f"ours on {workload} chain N={n}: {plain[0]:.3f}s CPU unprofiled (best of 3), floor {plain[1]:.3f}s, "
        f"c/d = {plain[0] / plain[1]:.2f}x. Profiled run: {total:.3f}s.\n\n"
        f"Garbage collection (unprofiled runs, gc.callbacks):\n" + "".join(gc_lines) + "\n"
        "Phases of the run (cumulative time, share of the profiled run):\n"
    )
    subs = [p for p in ours.container.passes if isinstance(p, SubPass)]
    accounted = 0.0
    for label, keys in _phases(subs):
        seconds = sum(entries[k][3] for k in keys if k in entries)
        calls = sum(entries[k][1] for k in keys if k in entries)
        if not label.startswith(" "):
            accounted += seconds
        out.write(f"  {seconds / total:6.1%}  {seconds:7.3f}s  {calls:>7} calls  {label}\n")
    out.write(
        f"  {(total - accounted) / total:6.1%}  {total - accounted:7.3f}s  {'':>13}  everything else\n\n"
    )
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()
