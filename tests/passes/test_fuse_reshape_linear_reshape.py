"""``generic::fuse_reshape_linear_reshape``: reshapes around ``linear`` / unary ops that cancel out."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.convert import convert_mil, op_counts
from pattern_infra.testing.passes import assert_same_program, op_types, run_pass
from pattern_infra.testing.real_models import compare_model
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::fuse_reshape_linear_reshape"
RNG = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def check(prog: Program, expected: list[str]) -> Program:
    """Runs the pass; demands op types ``expected`` (``op_types(prog)``: untouched) and equal outputs."""
    ours = run_pass(PASS, prog)
    assert op_types(ours) == expected, op_types(ours)
    if expected == op_types(prog):
        assert_same_program(prog, ours)
    else:
        assert_programs_equivalent(prog, ours, rtol=1e-5)
    return ours


def reshape_linear(
    x_shape=(1, 16, 8), flat_shape=(16, 8), out_shape=(1, 16, 5), *, extra: str | None = None
) -> Program:
    """``reshape(x, flat) -> linear(W[5, D], b) -> reshape(out)``, then a ``relu`` reading the result."""
    d_in = flat_shape[-1]
    weight, bias = f32(5, d_in), f32(5)

    @mb.program(input_specs=[mb.TensorSpec(shape=x_shape)])
    def prog(x):
        flat = mb.reshape(x=x, shape=list(flat_shape), name="flat")
        lin = mb.linear(x=flat, weight=weight, bias=bias, name="lin")
        out = mb.reshape(x=lin, shape=list(out_shape), name="out")
        if extra == "out_is_output":
            return out
        y = mb.relu(x=out, name="y")
        if extra == "use_flat":
            return y, mb.exp(x=flat, name="other")
        if extra == "use_lin":
            return y, mb.exp(x=lin, name="other")
        if extra == "lin_is_output":
            return y, lin
        if extra == "use_root":
            return y, mb.exp(x=x, name="other")
        return y

    return prog


@pytest.mark.parametrize(
    ("x_shape", "flat_shape", "out_shape"),
    [
        ((1, 16, 8), (16, 8), (1, 16, 5)),  # GPT-2's Conv1D
        ((2, 3, 8), (6, 8), (2, 3, 5)),
        ((2, 3, 8), (-1, 8), (2, 3, 5)),  # -1 in the shape constant: the inferred shape decides
        ((6, 8), (2, 3, 8), (6, 5)),  # regroups rows the other way (rank 3 in the middle)
        ((2, 3, 8), (3, 2, 8), (2, 3, 5)),  # regroups rows, same count
        ((8,), (1, 8), (5,)),  # rank 1
    ],
    ids=["conv1d", "merge_leading", "minus_one", "split_rows", "regroup", "rank1"],
)
def test_linear_fused(x_shape, flat_shape, out_shape):
    ours = check(reshape_linear(x_shape, flat_shape, out_shape), ["linear", "relu"])
    fused = ours.functions["main"].find_ops(op_type="linear")[0]
    assert fused.outputs[0].name == "out"
    assert tuple(fused.outputs[0].shape) == x_shape[:-1] + (5,)


@pytest.mark.parametrize("extra", ["out_is_output", "use_root"])
def test_linear_fused_at_block_output_and_with_shared_root(extra):
    expected = ["linear"] if extra == "out_is_output" else ["linear", "relu", "exp"]
    check(reshape_linear(extra=extra), expected)


@pytest.mark.parametrize(
    ("x_shape", "flat_shape", "out_shape"),
    [
        ((2, 3, 8), (6, 8), (3, 2, 5)),  # leading dims not restored
        ((2, 3, 8), (6, 8), (1, 6, 5)),  # leading dims merged, not restored
        ((2, 3, 8), (12, 4), (2, 3, 10)),  # the first reshape splits rows: not a row regrouping
        ((1, 2, 3, 8), (6, 8), (1, 2, 3, 5)),  # rank 4: beyond linear's rank 1-3
    ],
    ids=["not_restored", "merged_not_restored", "splits_last_dim", "rank4"],
)
def test_linear_shapes_declined(x_shape, flat_shape, out_shape):
    prog = reshape_linear(x_shape, flat_shape, out_shape)
    check(prog, op_types(prog))


def test_linear_symbolic_shape_declined():
    n = get_new_symbol()
    weight, bias = f32(5, 8), f32(5)

    @mb.program(input_specs=[mb.TensorSpec(shape=(n, 8))])
    def prog(x):
        flat = mb.reshape(x=x, shape=[1, -1, 8], name="flat")
        lin = mb.linear(x=flat, weight=weight, bias=bias, name="lin")
        return mb.reshape(x=lin, shape=[-1, 5], name="out")

    check(prog, op_types(prog))


@pytest.mark.parametrize("extra", ["use_flat", "use_lin", "lin_is_output"])
def test_linear_intermediate_used_elsewhere(extra):
    prog = reshape_linear(extra=extra)
    check(prog, op_types(prog))


def reshape_unary(
    op: str = "gelu",
    x_shape=(16, 32),
    mid_shape=(1, 16, 32),
    out_shape=None,
    extra: str | None = None,
    **params,
) -> Program:
    """``reshape(x, mid) -> op(**params) -> reshape(out or x's shape)``, then a ``relu``."""
    out_shape = x_shape if out_shape is None else out_shape

    @mb.program(input_specs=[mb.TensorSpec(shape=x_shape)])
    def prog(x):
        mid = mb.reshape(x=x, shape=list(mid_shape), name="mid")
        act = getattr(mb, op)(x=mid, name="act", **params)
        out = mb.reshape(x=act, shape=list(out_shape), name="out")
        y = mb.relu(x=out, name="y")
        if extra == "use_mid":
            return y, mb.exp(x=mid, name="other")
        if extra == "act_is_output":
            return y, act
        return y

    return prog


@pytest.mark.parametrize(
    ("op", "params"),
    [
        ("gelu", {"mode": "TANH_APPROXIMATION"}),
        ("gelu", {}),
        ("relu", {}),
        ("sigmoid", {}),
        ("leaky_relu", {"alpha": 0.2}),
        ("clip", {"alpha": -0.5, "beta": 0.5}),
        ("silu", {}),
        ("tanh", {}),
    ],
    ids=["gelu_tanh", "gelu_exact", "relu", "sigmoid", "leaky_relu", "clip", "silu", "tanh"],
)
def test_unary_fused(op, params):
    ours = check(reshape_unary(op, **params), [op, "relu"])
    fused = ours.functions["main"].find_ops(op_type=op)[0]
    assert fused.outputs[0].name == "out"
    for slot, value in params.items():
        got = getattr(fused, slot).val
        assert got == value if isinstance(value, str) else got == pytest.approx(value)


def test_unary_cast_keeps_its_dtype():
    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 6))])
    def prog(x):
        mid = mb.reshape(x=x, shape=[2, 12], name="mid")
        act = mb.cast(x=mid, dtype="fp16", name="act")
        return mb.reshape(x=act, shape=[4, 6], name="out")

    ours = check(prog, ["cast"])
    assert ours.functions["main"].outputs[0].dtype == types.fp16


@pytest.mark.parametrize(
    "prog",
    [
        lambda: reshape_unary(out_shape=(32, 16)),  # not reshaped back to x's shape
        lambda: reshape_unary("softmax", axis=-1),  # not elementwise
        lambda: reshape_unary(extra="use_mid"),
        lambda: reshape_unary(extra="act_is_output"),
    ],
    ids=["not_restored", "softmax", "intermediate_used", "intermediate_block_output"],
)
def test_unary_declined(prog):
    p = prog()
    check(p, op_types(p))


def test_unary_tensor_parameter_declined():
    """``prelu``'s per-channel alpha depends on the layout: it is not in the unary list at all."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4, 6, 2))])
    def prog(x):
        mid = mb.reshape(x=x, shape=[1, 6, 4, 2], name="mid")
        act = mb.prelu(x=mid, alpha=f32(6), name="act")
        return mb.reshape(x=act, shape=[1, 4, 6, 2], name="out")

    check(prog, op_types(prog))


def test_gpt2_mlp_chain_loses_every_reshape():
    """``reshape -> linear -> reshape -> gelu -> reshape -> linear -> reshape`` (GPT-2's MLP)."""
    w1, b1, w2, b2 = f32(32, 8), f32(32), f32(8, 32), f32(8)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 16, 8))])
    def prog(x):
        h = mb.reshape(x=x, shape=[-1, 8], name="v1")
        h = mb.linear(x=h, weight=w1, bias=b1, name="fc")
        h = mb.reshape(x=h, shape=[1, 16, 32], name="v2")
        h = mb.gelu(x=h, mode="TANH_APPROXIMATION", name="act")
        h = mb.reshape(x=h, shape=[-1, 32], name="v3")
        h = mb.linear(x=h, weight=w2, bias=b2, name="proj")
        return mb.reshape(x=h, shape=[1, 16, 8], name="v4")

    ours = check(prog, ["linear", "gelu", "linear"])
    assert [op.name for op in ours.functions["main"].operations if op.op_type != "const"] == [
        "v2",
        "act",
        "v4",
    ]


def test_unary_between_non_linear_ops():
    """Pattern 2 alone: the reshapes around the activation do not touch a ``linear``."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(16, 32))])
    def prog(x):
        h = mb.mul(x=x, y=2.0, name="pre")
        h = mb.reshape(x=h, shape=[1, 16, 32], name="mid")
        h = mb.gelu(x=h, name="act")
        h = mb.reshape(x=h, shape=[16, 32], name="out")
        return mb.add(x=h, y=1.0, name="post")

    check(prog, ["mul", "gelu", "add"])


def test_runs_after_fuse_leaky_relu_only_under_override():
    assert PASS_REGISTRY[PASS] in PASS_REGISTRY["common::fuse_leaky_relu"].followers
    prog = reshape_linear((2, 3, 8), (6, 8), (2, 3, 5))
    kwargs = {"minimum_deployment_target": ct.target.iOS16}
    off = convert_mil(prog, override=False, **kwargs)
    on = convert_mil(prog, override=True, **kwargs)
    assert op_counts(off)["reshape"] == 2 and op_counts(on)["reshape"] == 0
    assert_programs_equivalent(off, on, rtol=1e-5)


def test_gpt2_block_has_fewer_ops_with_override():
    row = compare_model("gpt2_block")
    assert row.fired.get(PASS) == 4  # the four Conv1D layers
    # relations, not the installed torch's counts: only reshapes go, and some do
    assert row.total_off - row.total_on == row.ops_off["reshape"] - row.ops_on["reshape"] > 0
    assert row.ops_on["linear"] == row.ops_off["linear"] == 4
    tolerance = 1e-5 * max(1.0, row.scale)
    assert row.max_abs_err_off < tolerance and row.max_abs_err_on < tolerance
