"""``common::fuse_gelu_exact``: every erf form coremltools fuses, same program, numerics, refusals.

The symbolic proof is done once per pattern (``test_pattern_equals_its_replacement_symbolically``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.fuse_gelu_exact import GELU_EXACT_PATTERNS
from pattern_infra.testing.passes import (
    assert_same_program,
    check_fused,
    check_not_fused,
    op_types,
    run_both,
    run_pass,
)
from pattern_infra.verification.symbolic import prove_equivalent
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_gelu_exact"
SHAPE = (2, 3, 4)
INV_SQRT2 = 0.7071067690849304  # float32(1 / sqrt(2)), what divide_to_multiply leaves in converted models


def _mul(a: Var, b: Var, swap: bool, **kw) -> Var:
    return mb.mul(x=b, y=a, **kw) if swap else mb.mul(x=a, y=b, **kw)


def gelu_erf(
    scale: str = "mul",
    tail: int = 3,
    swap: bool = False,
    *,
    half: float = 0.5,
    one: float = 1.0,
    extra: str | None = None,
) -> Program:
    """``0.5 * x * (1 + erf(x / sqrt(2)))`` in one of the 2 x 3 forms, every commutative op swappable.

    ``extra`` adds a use of an intermediate: ``"use_erf"`` (another consumer of ``erf``),
    ``"out_add"`` (``add`` also a block output), ``"use_root"`` (``x`` used elsewhere),
    ``"use_half_x"`` (tail 3's ``mul(0.5, x)`` used elsewhere).
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        if scale == "div":
            scaled = mb.real_div(x=x, y=math.sqrt(2.0), name="scale")
        else:
            scaled = _mul(x, INV_SQRT2, swap, name="scale")
        erf = mb.erf(x=scaled, name="erf")
        add = mb.add(x=one, y=erf, name="add") if swap else mb.add(x=erf, y=one, name="add")
        half_x = None
        if tail == 1:
            y = _mul(_mul(add, half, swap, name="half"), x, swap, name="y")
        elif tail == 2:
            y = _mul(_mul(add, x, swap, name="times_x"), half, swap, name="y")
        else:
            half_x = _mul(x, half, swap, name="half_x")
            y = _mul(add, half_x, swap, name="y")
        if extra == "use_erf":
            return y, mb.exp(x=erf)
        if extra == "out_add":
            return y, add
        if extra == "use_root":
            return y, mb.exp(x=x)
        if extra == "use_half_x":
            return y, mb.exp(x=half_x)
        return y

    return prog


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
@pytest.mark.parametrize("tail", [1, 2, 3])
@pytest.mark.parametrize("scale", ["div", "mul"])
def test_every_form_is_fused_as_coremltools_does(scale, tail, swap):
    prog = gelu_erf(scale, tail, swap)
    ours = check_fused(PASS, prog, ["gelu"])
    (gelu,) = [op for op in ours.functions["main"].operations if op.op_type == "gelu"]
    assert gelu.mode.val == "EXACT" and gelu.outputs[0].name == "y"


@pytest.mark.parametrize("tail", [1, 2, 3])
def test_root_with_other_consumers_is_fused(tail):
    check_fused(PASS, gelu_erf("mul", tail, extra="use_root"), ["gelu", "exp"])


@pytest.mark.parametrize(
    "extra", ["use_erf", "out_add"], ids=["intermediate_used_elsewhere", "intermediate_is_block_output"]
)
def test_intermediate_outside_the_match_is_not_fused(extra):
    check_not_fused(PASS, gelu_erf("mul", 3, extra=extra))


@pytest.mark.parametrize(
    "kwargs",
    [{"half": 0.6}, {"one": 2.0}],
    ids=["half_is_not_0.5", "one_is_not_1"],
)
def test_wrong_constant_is_not_fused(kwargs):
    check_not_fused(PASS, gelu_erf("mul", 1, **kwargs))


def test_wrong_scale_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        erf = mb.erf(x=mb.mul(x=x, y=0.5))
        return mb.mul(x=mb.mul(x=mb.add(x=erf, y=1.0), y=0.5), y=x)

    assert op_types(run_pass(PASS, prog)) == op_types(prog)


def test_half_x_used_elsewhere_is_declined_where_coremltools_raises():
    """Tail 3 with ``0.5 * x`` used elsewhere: coremltools' pass tries to remove it and raises."""
    prog = gelu_erf("mul", 3, extra="use_half_x")
    with pytest.raises(ValueError):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)


def test_broadcasting_constant_is_declined():
    """A size-1 constant of higher rank than ``x`` makes the output (1, 3): ``gelu(x)`` is (3,).

    coremltools fuses anyway and silently changes the program's output shape; we decline.
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=(3,))])
    def prog(x):
        erf = mb.erf(x=mb.mul(x=x, y=INV_SQRT2))
        half_x = mb.mul(x=x, y=np.full((1, 1), 0.5, dtype=np.float32))
        return mb.mul(x=mb.add(x=erf, y=1.0), y=half_x)

    assert run_pass(PASS, prog, generic=False).functions["main"].outputs[0].shape == (3,)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == op_types(prog)
    assert ours.functions["main"].outputs[0].shape == (1, 3)


def test_symbolic_shape_is_fused():
    from coremltools.converters.mil.mil import get_new_symbol

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), 4))])
    def prog(x):
        erf = mb.erf(x=mb.real_div(x=x, y=math.sqrt(2.0)))
        return mb.mul(x=mb.mul(x=mb.add(x=erf, y=1.0), y=0.5), y=x, name="y")

    outcome = run_both(PASS, prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    assert op_types(outcome.ours) == ["gelu"]


def test_two_gelus_in_sequence_are_both_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        for _ in range(2):
            erf = mb.erf(x=mb.mul(x=x, y=INV_SQRT2))
            x = mb.mul(x=mb.add(x=erf, y=1.0), y=mb.mul(x=x, y=0.5))
        return x

    check_fused(PASS, prog, ["gelu", "gelu"])


@pytest.mark.parametrize("pattern", GELU_EXACT_PATTERNS, ids=[f"pattern{i}" for i in range(6)])
def test_pattern_equals_its_replacement_symbolically(pattern):
    fused = run_pass(PASS, pattern)
    assert op_types(fused) == ["gelu"]
    assert (proof := prove_equivalent(pattern, fused)).proven, proof


def test_gelu_inside_a_nested_block_is_fused_as_coremltools_does():
    from coremltools.converters.mil.mil import types

    def gelu(x):
        erf = mb.erf(x=mb.mul(x=x, y=INV_SQRT2))
        return mb.mul(x=mb.add(x=erf, y=1.0), y=mb.mul(x=x, y=0.5))

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=(1,), dtype=types.bool)])
    def prog(x, flag):
        return mb.cond(pred=mb.squeeze(x=flag), _true_fn=lambda: gelu(x), _false_fn=lambda: mb.exp(x=x))

    outcome = run_both(PASS, prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    true_block = [op for op in outcome.ours.functions["main"].operations if op.op_type == "cond"][0].blocks[0]
    assert [op.op_type for op in true_block.operations if op.op_type != "const"] == ["gelu"]
    for flag in (True, False):
        inputs = {"x": np.random.default_rng(0).standard_normal(SHAPE), "flag": np.array([flag])}
        assert_programs_equivalent(prog, outcome.ours, inputs=inputs, rtol=1e-5)
