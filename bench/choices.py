"""``python -m bench.choices``: matching cost of one pattern with 12 spellings against patterns with one.

RMSNorm written 12 ways (``x*x`` | ``pow(x, 2)``; ``x*rsqrt(v)`` | ``x/sqrt(v)`` | ``x*(1/sqrt(v))``;
weighted or not). Three ways to find them, read-only (``find_in_program``, the driver's search loop):

* **one pattern, 12 alternatives**: ``tests/test_choices.py``'s ``rms_norm`` (``one_of``, ``optional``);
* **one pattern, 1 spelling**: the first spelling written out, on a program of that spelling only;
* **12 patterns**: each spelling written out, one search per pattern (what a pass needed before).

Printed per program: matches, bind attempts per match (deterministic: the matcher's unit of work) and
the best of 5 times per match (noisy on a shared machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")

import logging
import sys
import time
from pathlib import Path
from typing import Any

logging.getLogger("coremltools").setLevel(logging.ERROR)

from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import Program  # noqa: E402

from pattern_infra import Matcher, compile_pattern  # noqa: E402
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


def main(n: int = 120) -> None:
    """Prints the table (``n`` RMSNorms per program)."""
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
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 120)
