"""``python -m bench.choices``: matching cost of one pattern with 12 spellings against patterns with one.

RMSNorm written 12 ways (``x*x`` | ``pow(x, 2)``; ``x*rsqrt(v)`` | ``x/sqrt(v)`` | ``x*(1/sqrt(v))``;
weighted or not). Three tables:

1. **The pass's search** (a pass takes the first match at an anchor): on 120 RMSNorms of the first
   spelling, the pattern written with 1 spelling (written out), 2 (``one_of`` for the square), 6 (and
   ``one_of`` for the normaliser) and 12 (and ``optional`` weight: ``tests/test_choices.py``'s
   ``rms_norm``). Per match: bind attempts (deterministic), best-of-7 microseconds (noisy on a shared
   machine) and, with ``--instructions``, machine instructions counted by valgrind's callgrind
   (deterministic; a few minutes per row).
2. **One choice point, k alternatives**: ``scale -> act -> shift`` where ``act`` is ``one_of`` 2, 4 or
   12 unary ops (:data:`ACTIVATIONS`), against the activation written out; on ``n`` instances of the
   first alternative, and of the last one of 12 (the eleven before it are passed over by the dispatch
   on the op type). Same columns as table 1: what a choice point costs, and that its number of
   alternatives does not add to it.
3. **Every match** (``find_in_program``, what ``find_matches`` does), read-only: the 12-spelling pattern,
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
from pattern_infra.authoring.find import anchored_blocks, find_in_program  # noqa: E402
from pattern_infra.language.choices import one_of  # noqa: E402

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
    before = sum(m.stats.bind_attempts for m in matchers)
    best = float("inf")
    for _rep in range(5):
        start = time.perf_counter()
        count = sum(1 for m in matchers for _ in find_in_program(prog, m, None))
        best = min(best, time.perf_counter() - start)
        found = count
    binds = (sum(m.stats.bind_attempts for m in matchers) - before) / 5
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
            v = mb.add(
                x=mb.reduce_mean(x=square(x), axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var"
            )
            return mb.mul(x=mb.mul(x=x, y=mb.rsqrt(x=v, name="inv"), name="scale"), y=w, name="weight")

        return pattern

    def six() -> Program:
        @mb.program(input_specs=ROW_AND_WEIGHT)
        def pattern(x, w):
            v = mb.add(
                x=mb.reduce_mean(x=square(x), axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var"
            )
            return mb.mul(x=normed(x, v), y=w, name="weight")

        return pattern

    return {"1": lambda: _name_ops(written_out(spellings[0])), "2": two, "6": six, "12": lambda: rms_norm}


ACTIVATIONS = (
    "relu",
    "sigmoid",
    "tanh",
    "exp",
    "abs",
    "sin",
    "cos",
    "floor",
    "ceil",
    "erf",
    "softplus",
    "square",
)
"""The alternatives of table 2's choice point, in the order written."""


def activation_pattern(k: int, written: str = "") -> Program:
    """``shift(act(scale(x)))``: ``act`` one of the first ``k`` :data:`ACTIVATIONS`, or the op ``written``
    written out."""

    def act(h: Any) -> Any:
        if written:
            return getattr(mb, written)(x=h, name="act")
        return one_of("act", *[lambda t=t: getattr(mb, t)(x=h, name="f") for t in ACTIVATIONS[:k]])

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 8))])
    def pattern(x):
        return mb.add(x=act(mb.mul(x=x, y=2.0, name="scale")), y=1.0, name="shift")

    return pattern


def activation_chain(op_type: str, n: int) -> Program:
    """``n`` instances of ``add(op_type(mul(x, 2)), 1)`` side by side on one input."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 8))])
    def prog(x):
        return tuple(mb.add(x=getattr(mb, op_type)(x=mb.mul(x=x, y=2.0)), y=1.0) for _ in range(n))

    return prog


ACTIVATION_ROWS = {
    "written out": (lambda: activation_pattern(1, ACTIVATIONS[0]), ACTIVATIONS[0]),
    "2, first": (lambda: activation_pattern(2), ACTIVATIONS[0]),
    "4, first": (lambda: activation_pattern(4), ACTIVATIONS[0]),
    "12, first": (lambda: activation_pattern(12), ACTIVATIONS[0]),
    "written out (last)": (lambda: activation_pattern(1, ACTIVATIONS[-1]), ACTIVATIONS[-1]),
    "12, last": (lambda: activation_pattern(12), ACTIVATIONS[-1]),
}
"""Table 2: row -> (its pattern, the op type of the program's activations)."""


def _pass_search(row: str, n: int) -> tuple[Matcher, Program]:
    """The matcher of a row of table 1 (the pattern allowing ``row`` spellings, on ``n`` RMSNorms of the
    first spelling) or of table 2 (a key of :data:`ACTIVATION_ROWS`), searched once (the searches are
    generated)."""
    if row in ACTIVATION_ROWS:
        pattern, op_type = ACTIVATION_ROWS[row]
        matcher, prog = Matcher(compile_pattern(pattern(), constants="const")), activation_chain(op_type, n)
    else:
        matcher = Matcher(compile_pattern(spelling_patterns()[row](), constants="const"))
        prog = chain(_spellings()[1][:1], n)
    first_matches(matcher, prog)
    return matcher, prog


def pass_search_row(row: str, n: int) -> tuple[float, float]:
    """(bind attempts, best seconds) per match of the pass's search of ``row`` (:func:`_pass_search`)."""
    matcher, prog = _pass_search(row, n)
    before, best = matcher.stats.bind_attempts, float("inf")
    for _ in range(7):
        gc.collect()
        gc.disable()  # as in a pass (the driver pauses it): the collector's pauses are not the search's cost
        start = time.perf_counter()
        found = first_matches(matcher, prog)
        best = min(best, time.perf_counter() - start)
        gc.enable()
    return (matcher.stats.bind_attempts - before) / 7 / found, best / found


def _counted(row: str, n: int) -> None:
    """What runs under callgrind: one uncounted search, then ``REPEATS`` counted ones."""
    matcher, prog = _pass_search(row, n)
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
    tables = [
        (
            f"The pass's search, {n} RMSNorms of one spelling (first match taken):",
            "spellings",
            list(spelling_patterns()),
        ),
        (
            f"One choice point, k alternatives, {n} matches of the first (or last) (first match taken):",
            "k, matched",
            list(ACTIVATION_ROWS),
        ),
    ]
    for title, column, rows in tables:
        print(title)
        print(
            f"{column:>18} {'binds/match':>12} {'us/match':>9}"
            + (f" {'instructions/match':>19}" if args.instructions else "")
        )
        for row in rows:
            binds, seconds = pass_search_row(row, n)
            line = f"{row:>18} {binds:>12.1f} {seconds * 1e6:>9.1f}"
            if args.instructions:
                counted = count_instructions(["-m", "bench.choices", str(n), "--counted", row])
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
    print(
        f"{'program':<24} {'search':<30} {'matches':>7} {'binds/match':>12} {'us/match':>9} {'ms total':>9}"
    )
    for program, search, matchers, prog in rows:
        found, binds, seconds = measure(matchers, prog)
        print(
            f"{program:<24} {search:<30} {found:>7} {binds:>12.1f} {seconds * 1e6:>9.1f} "
            f"{seconds * found * 1e3:>9.1f}"
        )
    print("(12 patterns also match the unweighted part of every weighted spelling: 180 matches, not 120)")


if __name__ == "__main__":
    main()
