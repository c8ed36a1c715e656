"""``python -m bench.choices``: matching cost of one pattern with 12 spellings against patterns with one.

RMSNorm written 12 ways (``x*x`` | ``pow(x, 2)``; ``x*rsqrt(v)`` | ``x/sqrt(v)`` | ``x*(1/sqrt(v))``;
weighted or not). Two tables:

1. **The pass's search** (a pass takes the first match at an anchor): on 120 RMSNorms of the first
   spelling, the pattern written with 1 spelling (written out), 2 (``one_of`` for the square), 6 (and
   ``one_of`` for the normaliser) and 12 (and ``optional`` weight: ``tests/test_choices.py``'s
   ``rms_norm``). Per match: bind attempts (deterministic), best-of-7 microseconds (noisy on a shared
   machine) and, with ``--instructions``, machine instructions counted by valgrind's callgrind
   (deterministic; a few minutes per row).
2. **Every match** (``find_in_program``, what ``find_matches`` does), read-only: the 12-spelling pattern,
   the one spelling written out, and 12 patterns (what a pass needed before) on a program of all 12
   spellings.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import argparse
import gc
import logging
import operator
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logging.getLogger("coremltools").setLevel(logging.ERROR)

from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import Program  # noqa: E402

from bench.instructions import count_instructions  # noqa: E402
from pattern_infra import Matcher, compile_pattern  # noqa: E402
from pattern_infra.blocks import anchored_blocks  # noqa: E402
from pattern_infra.choices import one_of  # noqa: E402
from pattern_infra.find import find_in_program  # noqa: E402

__all__ = ["main"]


def _spellings() -> tuple[Any, list[tuple[str, str, bool]], dict[str, Any], dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_choices import NORMALIZERS, SPELLINGS, SQUARES, rms_norm

    return rms_norm, SPELLINGS, SQUARES, NORMALIZERS


def chain(spellings: list[tuple[str, str, bool]], n: int) -> Program:
    """``n`` RMSNorms side by side on one input, cycling through ``spellings``."""
    _, _, squares, norms = _spellings()

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 8)), mb.TensorSpec(shape=(8,))])
    def prog(x, w):
        outs = []
        for i in range(n):
            square, norm, weighted = spellings[i % len(spellings)]
            v = mb.add(x=mb.reduce_mean(x=squares[square](x), axes=[-1], keep_dims=True), y=1e-6)
            y = norms[norm](x, v)
            outs.append(mb.relu(x=mb.mul(x=y, y=w) if weighted else y))
        return tuple(outs)

    return prog


def written_out(spelling: tuple[str, str, bool]) -> Program:
    """One spelling as a plain pattern program."""
    _, _, squares, norms = _spellings()
    square, norm, weighted = spelling
    specs = [mb.TensorSpec(shape=(3, 8)), mb.TensorSpec(shape=(8,))]

    def body(x, w):
        v = mb.add(x=mb.reduce_mean(x=squares[square](x), axes=[-1], keep_dims=True), y=1e-6)
        y = norms[norm](x, v)
        return mb.mul(x=y, y=w) if weighted else y

    if weighted:
        return mb.program(input_specs=specs)(lambda x, w: body(x, w))
    return mb.program(input_specs=specs[:1])(lambda x: body(x, None))


def _name_ops(prog: Program) -> Program:
    for i, op in enumerate(prog.functions["main"].operations):
        if op.op_type != "const":
            op.name = f"{op.op_type}_{i}"
    return prog


def measure(matchers: list[Matcher], prog: Program) -> tuple[int, float, float]:
    """(matches, bind attempts per match, best seconds per match) of searching ``prog`` with each."""
    found = 0
    before = sum(m.bind_attempts for m in matchers)
    best = float("inf")
    for rep in range(5):
        start = time.perf_counter()
        count = sum(1 for m in matchers for _ in find_in_program(prog, m, None))
        best = min(best, time.perf_counter() - start)
        found = count
    binds = (sum(m.bind_attempts for m in matchers) - before) / 5
    return found, binds / max(found, 1), best / max(found, 1)


def first_matches(matcher: Matcher, prog: Program) -> int:
    """Searches ``prog`` as a pass does, taking the first match at each anchor op; returns the matches."""
    taken = 0
    for st, anchor, candidates in anchored_blocks(prog, matcher):
        for found in st.tries(matcher, anchor, candidates, lambda match: True):
            taken += found is not None
    return taken


def spelling_patterns() -> dict[str, Callable[[], Any]]:
    """Spellings allowed -> the RMSNorm pattern allowing them (all match the first spelling)."""
    rms_norm, spellings, _, _ = _spellings()
    from test_choices import ROW_AND_WEIGHT, normed

    def square(x: Any) -> Any:
        return one_of("square", lambda: mb.mul(x=x, y=x, name="sq"), lambda: mb.pow(x=x, y=2.0, name="sq"))

    def two() -> Program:
        @mb.program(input_specs=ROW_AND_WEIGHT)
        def pattern(x, w):
            v = mb.add(x=mb.reduce_mean(x=square(x), axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var")
            return mb.mul(x=mb.mul(x=x, y=mb.rsqrt(x=v, name="inv"), name="scale"), y=w, name="weight")

        return pattern

    def six() -> Program:
        @mb.program(input_specs=ROW_AND_WEIGHT)
        def pattern(x, w):
            v = mb.add(x=mb.reduce_mean(x=square(x), axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var")
            return mb.mul(x=normed(x, v), y=w, name="weight")

        return pattern

    return {"1": lambda: _name_ops(written_out(spellings[0])), "2": two, "6": six, "12": lambda: rms_norm}


def _pass_search(spellings: str, n: int) -> tuple[Matcher, Program]:
    """The matcher of the pattern allowing ``spellings`` and ``n`` RMSNorms of the first spelling,
    searched once (the searches are generated)."""
    matcher = Matcher(compile_pattern(spelling_patterns()[spellings](), constants="const"))
    prog = chain(_spellings()[1][:1], n)
    first_matches(matcher, prog)
    return matcher, prog


def pass_search_row(spellings: str, n: int) -> tuple[float, float]:
    """(bind attempts, best seconds) per match of the pass's search with the pattern of ``spellings``."""
    matcher, prog = _pass_search(spellings, n)
    before, best = matcher.bind_attempts, float("inf")
    for _ in range(7):
        gc.collect()
        gc.disable()  # as in a pass (gc_pause): the collector's pauses are not the search's cost
        start = time.perf_counter()
        found = first_matches(matcher, prog)
        best = min(best, time.perf_counter() - start)
        gc.enable()
    return (matcher.bind_attempts - before) / 7 / found, best / found


def _counted(spellings: str, n: int) -> None:
    """What runs under callgrind: one uncounted search, then ``REPEATS`` counted ones."""
    matcher, prog = _pass_search(spellings, n)
    gc.collect()
    gc.disable()
    for _ in range(REPEATS):
        operator.call(first_matches, matcher, prog)


REPEATS = 3
"""Counted searches per row under callgrind."""


def main(argv: list[str] | None = None) -> None:
    """Prints the tables."""
    parser = argparse.ArgumentParser(prog="python -m bench.choices", description=__doc__.split("\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=120, help="RMSNorms per program")
    parser.add_argument("--instructions", action="store_true", help="also count instructions (valgrind)")
    parser.add_argument("--counted", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.counted:
        _counted(args.counted, args.n)
        return
    n = args.n
    print(f"The pass's search, {n} RMSNorms of one spelling (first match taken):")
    print(f"{'spellings':>9} {'binds/match':>12} {'us/match':>9}" + (f" {'instructions/match':>19}" if args.instructions else ""))
    for spellings in spelling_patterns():
        binds, seconds = pass_search_row(spellings, n)
        line = f"{spellings:>9} {binds:>12.1f} {seconds * 1e6:>9.1f}"
        if args.instructions:
            counted = count_instructions(["-m", "bench.choices", str(n), "--counted", spellings])
            line += f" {counted // (REPEATS * n):>19,}"
        print(line, flush=True)
    print()
    print("Every match (find_in_program):")
    rms_norm, spellings, _, _ = _spellings()
    twelve = Matcher(compile_pattern(rms_norm, constants="const"))
    one = Matcher(compile_pattern(_name_ops(written_out(spellings[0])), constants="const"))
    separate = [Matcher(compile_pattern(_name_ops(written_out(s)), constants="const")) for s in spellings]
    same = chain(spellings[:1], n)
    mixed = chain(spellings, n)
    rows = [
        ("1 spelling x n", "one pattern, 12 alternatives", [twelve], same),
        ("1 spelling x n", "one pattern, 1 spelling", [one], same),
        ("12 spellings, n in all", "one pattern, 12 alternatives", [twelve], mixed),
        ("12 spellings, n in all", "12 patterns", separate, mixed),
    ]
    print(f"{'program':<24} {'search':<30} {'matches':>7} {'binds/match':>12} {'us/match':>9} {'ms total':>9}")
    for program, search, matchers, prog in rows:
        found, binds, seconds = measure(matchers, prog)
        print(f"{program:<24} {search:<30} {found:>7} {binds:>12.1f} {seconds * 1e6:>9.1f} "
              f"{seconds * found * 1e3:>9.1f}")
    print("(12 patterns also match the unweighted part of every weighted spelling: 180 matches, not 120)")


if __name__ == "__main__":
    main()
