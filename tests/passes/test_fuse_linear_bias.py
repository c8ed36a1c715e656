"""``common::fuse_linear_bias``: ``linear`` then ``add``/``sub`` of a constant, into one ``linear``.

``run_both`` compares programs by their text, and coremltools' builder names new constants with global
counters (``<op>_weight_0``, then ``<op>_weight_1`` the next time the same name is built), so the second
of two identical rewrites gets other constant names. ``both`` below is ``run_both`` with the counters
put back between the two runs; ``assert_identical`` adds the values and dtypes of the constants (the
text shows a constant's value only up to ten elements).
"""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import PassOutcome, assert_same_program, op_types, run_pass
from pattern_infra.verify import assert_programs_equivalent

PASS = "common::fuse_linear_bias"
RNG = np.random.default_rng(7)


def both(prog: Program) -> PassOutcome:
    """``run_both`` with coremltools' name counters equal at the start of both runs."""
    saved = dict(mb.name_count)
    reference = run_pass(PASS, prog, generic=False)
    mb.name_count.clear()
    mb.name_count.update(saved)
    return PassOutcome(prog, reference, run_pass(PASS, prog, generic=True))


def assert_identical(expected: Program, actual: Program) -> None:
    """Same program text, and every constant read by an op has the same name, dtype and value."""
    assert_same_program(expected, actual)

    def consts(prog):
        return [
            (op.name, slot, var.name, np.asarray(var.val))
            for op in prog.functions["main"].operations
            if op.op_type != "const"
            for slot, var in op.inputs.items()
            if not isinstance(var, (list, tuple)) and var.op is not None and var.op.op_type == "const"
        ]

    for (op, slot, name, a), (_, _, _, b) in zip(consts(expected), consts(actual), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{op}.{slot} ({name}) differs"


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def linear_prog(
    op: str = "add",
    linear_first: bool = True,
    c=None,
    x_shape=(2, 3),
    *,
    d_out: int = 4,
    extra: str | None = None,
) -> Program:
    """``linear(x) op c`` (or ``c op linear(x)``); ``extra`` adds an outside use or a dynamic ``c``."""
    weight, bias = f32(d_out, x_shape[-1]), f32(d_out)
    c = f32(d_out) if c is None else c

    @mb.program(input_specs=[mb.TensorSpec(shape=x_shape), mb.TensorSpec(shape=(d_out,))])
    def prog(x, z):
        lin = mb.linear(x=x, weight=weight, bias=bias, name="lin")
        other = z if extra == "dynamic_c" else c
        args = (lin, other) if linear_first else (other, lin)
        out = getattr(mb, op)(x=args[0], y=args[1], name="out")
        if extra == "use_linear":
            return out, mb.relu(x=lin)
        if extra == "out_linear":
            return out, lin
        if extra == "use_root":
            return out, mb.relu(x=x)
        return out, z

    return prog


def check_fused(prog: Program, expected: list[str]) -> Program:
    outcome = both(prog)
    assert_identical(outcome.coremltools, outcome.ours)
    assert op_types(outcome.ours) == expected
    assert_programs_equivalent(prog, outcome.ours)
    return outcome.ours


@pytest.mark.parametrize("c_shape", [(4,), (1, 4)], ids=["c_vec", "c_row"])
@pytest.mark.parametrize("linear_first", [True, False], ids=["linear_c", "c_linear"])
@pytest.mark.parametrize("op", ["add", "sub"])
def test_fused_as_coremltools_does(op, linear_first, c_shape):
    ours = check_fused(linear_prog(op, linear_first, f32(*c_shape)), ["linear"])
    fused = ours.functions["main"].find_ops(op_type="linear")[0]
    assert fused.outputs[0].name == "out"


@pytest.mark.parametrize("x_shape", [(3,), (2, 5, 3)], ids=["rank1", "rank3"])
def test_input_ranks(x_shape):
    check_fused(linear_prog("sub", False, x_shape=x_shape), ["linear"])


def test_chain_folds_into_one_linear():
    weight, bias = f32(4, 3), f32(4)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        lin = mb.linear(x=x, weight=weight, bias=bias)
        return mb.sub(x=f32(4), y=mb.add(x=f32(1, 4), y=lin))

    check_fused(prog, ["linear"])


def test_root_with_other_consumers_is_fused():
    check_fused(linear_prog(extra="use_root"), ["linear", "relu"])


def test_inside_a_nested_block():
    weight, bias, c = f32(4, 3), f32(4), f32(4)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        def branch():
            return mb.add(x=mb.linear(x=x, weight=weight, bias=bias), y=c)

        def other_branch():
            return mb.relu(x=mb.linear(x=x, weight=weight, bias=bias))

        return mb.cond(pred=True, _true_fn=branch, _false_fn=other_branch)

    outcome = both(prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    inner = outcome.ours.functions["main"].find_ops(op_type="cond")[0].blocks[0]
    assert [op.op_type for op in inner.operations if op.op_type != "const"] == ["linear"]
    assert_programs_equivalent(prog, outcome.ours)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"extra": "use_linear"},
        {"extra": "out_linear"},
        {"extra": "dynamic_c"},
        {"c": f32(2, 4)},
        {"c": f32(4, 1), "x_shape": (4, 3)},
    ],
    ids=["intermediate_used_elsewhere", "intermediate_is_block_output", "non_const_c",
         "c_too_many_values", "c_on_wrong_axis"],
)
def test_not_fused(kwargs):
    prog = linear_prog(**kwargs)
    outcome = both(prog)
    assert op_types(outcome.ours) == op_types(prog)
    assert_same_program(outcome.coremltools, outcome.ours)


def test_constexpr_weight_is_not_fused():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))], opset_version=ct.target.iOS16)
    def prog(x):
        weight = mb.constexpr_affine_dequantize(
            quantized_data=np.ones((4, 3), np.uint8), zero_point=np.uint8(0), scale=np.float32(0.5), axis=0
        )
        return mb.add(x=mb.linear(x=x, weight=weight, bias=f32(4)), y=f32(4))

    outcome = both(prog)
    assert op_types(outcome.ours) == op_types(prog)
    assert_same_program(outcome.coremltools, outcome.ours)


def test_c_that_raises_the_output_rank_is_not_fused():
    """coremltools fuses (2, 4) + (1, 1, 4) and the output loses its leading dimension."""
    prog = linear_prog(c=f32(1, 1, 4))
    outcome = both(prog)
    assert op_types(outcome.ours) == ["linear", "add"]
    assert outcome.coremltools.functions["main"].outputs[0].shape == (2, 4)
    assert outcome.ours.functions["main"].outputs[0].shape == (1, 2, 4)


def test_scalar_c_with_one_output_channel():
    """coremltools raises IndexError (it reads ``c.shape[-1]`` of a scalar); the fusion is right."""
    prog = linear_prog("sub", True, np.float32(0.75), d_out=1)
    with pytest.raises(IndexError):
        run_pass(PASS, prog, generic=False)
    ours = run_pass(PASS, prog, generic=True)
    assert op_types(ours) == ["linear"]
    assert_programs_equivalent(prog, ours)
