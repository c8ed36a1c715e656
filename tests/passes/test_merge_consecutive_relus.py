"""``common::merge_consecutive_relus``: ``relu(relu(x))`` chains of any length become one ``relu``."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import check_fused, op_types, run_both
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::merge_consecutive_relus"
SHAPE = (2, 3, 4)


def relu_chain(n: int, *, extra: str | None = None) -> Program:
    """``n`` chained ``relu`` ops; ``extra`` adds a use: ``"use_first"`` (first relu used by an ``exp``
    too), ``"out_first"`` (first relu is also a block output), ``"use_root"``."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        first = y = mb.relu(x=x, name="relu_first")
        for i in range(1, n):
            y = mb.relu(x=y, name=f"relu_{i}")
        if extra == "use_first":
            return y, mb.exp(x=first)
        if extra == "out_first":
            return y, first
        if extra == "use_root":
            return y, mb.exp(x=x)
        return y

    return prog


@pytest.mark.parametrize("n", [2, 3, 5])
def test_chain_becomes_one_relu(n):
    ours = check_fused(PASS, relu_chain(n), ["relu"], prove=True)
    (relu,) = [op for op in ours.functions["main"].operations if op.op_type == "relu"]
    assert relu.name == "relu_first" and ours.functions["main"].outputs == [relu.outputs[0]]


def test_root_with_other_consumers_is_merged():
    check_fused(PASS, relu_chain(3, extra="use_root"), ["relu", "exp"], prove=True)


def test_relu_with_two_relu_consumers_is_left_as_coremltools_leaves_it():
    """The first relu has two consumers: coremltools merges nothing; the tails of each branch merge."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        r = mb.relu(x=x, name="r")
        a = mb.relu(x=mb.relu(x=r, name="a1"), name="a2")
        b = mb.relu(x=r, name="b")
        return a, b

    ours = check_fused(PASS, prog, ["relu", "relu", "relu"], prove=True)
    assert [op.name for op in ours.functions["main"].operations if op.op_type == "relu"] == ["r", "a1", "b"]


def test_first_relu_used_elsewhere_stays():
    """The first relu also feeds an ``exp``: it keeps its successor; the rest of the chain merges."""
    check_fused(PASS, relu_chain(4, extra="use_first"), ["relu", "relu", "exp"], prove=True)


def test_first_relu_as_block_output_still_merges():
    """A block output is kept, not removed, so being one does not stop the merge (coremltools agrees)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        first = mb.relu(x=x, name="first")
        return mb.exp(x=mb.relu(x=first, name="second")), first

    check_fused(PASS, prog, ["relu", "exp"], prove=True)


def test_two_block_outputs_are_not_merged_into_one():
    """Chain of 4 returning its first and last relu: coremltools merges them into one variable and
    the block returns it twice (the output name ``relu_first`` is lost); ours keeps two relus."""
    prog = relu_chain(4, extra="out_first")
    outcome = run_both(PASS, prog)
    theirs = outcome.coremltools.functions["main"]
    assert [v.name for v in theirs.outputs] == ["relu_3", "relu_3"]
    ours = outcome.ours.functions["main"]
    assert op_types(outcome.ours) == ["relu", "relu"]
    assert [v.name for v in ours.outputs] == ["relu_3", "relu_first"]
    assert ours.outputs[0].op.x is ours.outputs[1]
    assert_programs_equivalent(prog, outcome.ours, rtol=1e-5)


def test_relu_after_another_op_is_not_touched():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        return mb.relu(x=mb.exp(x=mb.relu(x=x)))

    check_fused(PASS, prog, ["relu", "exp", "relu"], prove=True)
