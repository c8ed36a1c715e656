"""``generic::merge_reshape_transpose_chains``: reshape / expand_dims / squeeze / transpose chains in the
fewest ops, and the ops on both sides of a ``linear`` merged across it."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol, types

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes._layout import Layout
from generic_passes._shape_proof import ShapeFacts
from pattern_infra.testing.passes import check_new_pass, op_types, run_pass
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "generic::merge_reshape_transpose_chains"
RNG = np.random.default_rng(38)


def check(prog: Program, expected: list[str]) -> Program:
    """Runs the pass; demands op types ``expected`` and outputs equal to the element (movement is exact)."""
    return check_new_pass(PASS, prog, expected, rtol=0.0, atol=0.0)


def chain(shape, *ops, dtype=types.fp32, extra: str | None = None) -> Program:
    """``x`` through ``ops`` (``("reshape", shape)``, ``("transpose", perm)``, ``("expand_dims", axes)``,
    ``("squeeze", axes)``), then a ``relu``; ``extra`` uses the first op's output elsewhere."""

    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=dtype)])
    def prog(x):
        v, first = x, None
        for i, (kind, arg) in enumerate(ops):
            key = {"reshape": "shape", "transpose": "perm"}.get(kind, "axes")
            v = getattr(mb, kind)(x=v, name=f"{kind}_{i}", **{key: list(arg)})
            first = v if first is None else first
        y = mb.relu(x=v, name="y")
        if extra == "use_first":
            return y, mb.exp(x=first, name="other")
        if extra == "first_is_output":
            return y, first
        return y

    return prog


# torchvision's in-projection: view(17, 1, 3, 64), unsqueeze(0), transpose(0, -2), squeeze(-2)
TORCHVISION_QKV = (
    (17, 1, 192),
    ("reshape", (17, 1, 3, 64)),
    ("expand_dims", (0,)),
    ("transpose", (3, 1, 2, 0, 4)),
)


@pytest.mark.parametrize(
    ("shape", "ops", "expected"),
    [
        (TORCHVISION_QKV[0], (*TORCHVISION_QKV[1:], ("squeeze", (-2,))), ["reshape", "transpose"]),
        ((2, 12), (("reshape", (2, 3, 4)), ("reshape", (6, 4))), ["reshape"]),  # consecutive reshapes
        ((2, 3), (("expand_dims", (0,)), ("squeeze", (0,))), ["identity"]),  # a squeeze undoing an expand
        ((1, 17, 64), (("transpose", (1, 0, 2)), ("reshape", (17, 1, 4, 16))), ["reshape"]),  # unit axis
        ((2, 3, 4), (("transpose", (1, 0, 2)), ("transpose", (0, 2, 1))), ["transpose"]),
        (
            (1, 4, 17, 16),
            (("transpose", (2, 0, 1, 3)), ("reshape", (17, 64)), ("reshape", (1, 17, 64))),
            ["transpose", "reshape"],
        ),
        (
            (3, 17, 4, 16),
            (
                ("expand_dims", (1,)),
                ("squeeze", (1,)),
                ("transpose", (0, 2, 1, 3)),
                ("reshape", (3, 4, 17, 16)),
            ),
            ["transpose"],
        ),  # four ops
    ],
    ids=["torchvision_qkv", "reshapes", "expand_squeeze", "unit_transpose", "transposes", "out_proj", "four"],
)
def test_chain_fused(shape, ops, expected):
    prog = chain(shape, *ops)
    ours = check(prog, [*expected, "relu"])
    assert ours.functions["main"].find_ops(op_type="relu")[0].x.name == f"{ops[-1][0]}_{len(ops) - 1}"


def test_chain_fused_float16():
    prog = chain(TORCHVISION_QKV[0], *TORCHVISION_QKV[1:], ("squeeze", (-2,)), dtype=types.fp16)
    ours = check(prog, ["reshape", "transpose", "relu"])
    assert ours.functions["main"].find_ops(op_type="relu")[0].x.dtype == types.fp16


def test_chain_with_symbolic_batch():
    s = get_new_symbol()
    prog = chain((s, 4, 6), ("reshape", (-1, 24)), ("reshape", (-1, 2, 12)))
    ours = check(prog, ["reshape", "relu"])
    (reshape,) = ours.functions["main"].find_ops(op_type="reshape")
    assert list(reshape.shape.val) == [-1, 2, 12]


@pytest.mark.parametrize(
    ("shape", "ops"),
    [
        ((2, 3, 4), (("transpose", (1, 0, 2)), ("reshape", (3, 8)))),  # two ops are the fewest
        ((4, 3), (("transpose", (1, 0)), ("reshape", (2, 6)))),  # not a permutation of factors
    ],
    ids=["fewest_already", "not_a_permutation_of_factors"],
)
def test_chain_not_fused(shape, ops):
    check(chain(shape, *ops), [kind for kind, _ in ops] + ["relu"])


def layout_of(shape, *steps) -> Layout:
    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        return mb.relu(x=x)

    layout = Layout(ShapeFacts.of(prog.functions["main"]), shape)
    for step in steps:
        reason = layout.apply(step)
        if reason is not None:
            return reason
    return layout


def test_layout_plans_and_reasons():
    assert layout_of((4, 3), ("transpose", (1, 0)), ("reshape", (2, 6))) == (
        "reshape to [2, 6] cuts a factor of size 3 of [3, 4]"
    )
    assert layout_of((2, 3, 4), ("transpose", (1, 0, 2)), ("reshape", (3, 8))).plan() == [
        ("transpose", (1, 0, 2)),
        ("reshape", (3, 8)),
    ]
    # (12,) split as 3 x 4 then the factors swapped: reshape first, then transpose
    assert layout_of((12,), ("reshape", (3, 4)), ("transpose", (1, 0))).plan() == [
        ("reshape", (3, 4)),
        ("transpose", (1, 0)),
    ]
    # the blocks of factors: reshape -> transpose -> reshape, never more
    plan = layout_of(
        (6, 10), ("reshape", (2, 3, 2, 5)), ("transpose", (2, 0, 3, 1)), ("reshape", (4, 15))
    ).plan()
    assert [kind for kind, _ in plan] == ["reshape", "transpose", "reshape"]


def test_symbolic_size_not_proven_is_refused():
    s = get_new_symbol()  # 4 * s elements regrouped as (2, 2 * s): s / 2 is not proven an integer
    prog = chain((s, 4), ("reshape", (-1,)), ("reshape", (2, -1)))
    check(prog, ["reshape", "reshape", "relu"])


@pytest.mark.parametrize("extra", ["use_first", "first_is_output"])
def test_intermediate_used_elsewhere(extra):
    prog = chain((2, 12), ("reshape", (2, 3, 4)), ("reshape", (6, 4)), extra=extra)
    kinds = ["reshape", "reshape", "relu"] + (["exp"] if extra == "use_first" else [])
    check(prog, kinds)


def linear_prog(shape, before, out_features, after, *, dtype=types.fp32) -> Program:
    """``x -> before -> linear -> after -> relu``."""
    d_in = before[1][-1] if before[0] == "reshape" else shape[before[1][-1]]
    np_dtype = np.float16 if dtype == types.fp16 else np.float32
    weight = RNG.standard_normal((out_features, d_in)).astype(np_dtype)
    bias = RNG.standard_normal(out_features).astype(np_dtype)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=dtype)])
    def prog(x):
        key = {"reshape": "shape", "transpose": "perm"}
        v = getattr(mb, before[0])(x=x, name="before", **{key[before[0]]: list(before[1])})
        v = mb.linear(x=v, weight=weight, bias=bias, name="lin")
        v = getattr(mb, after[0])(x=v, name="after", **{key[after[0]]: list(after[1])})
        return mb.relu(x=v, name="y")

    return prog


@pytest.mark.parametrize("dtype", [types.fp32, types.fp16], ids=["fp32", "fp16"])
def test_linear_in_projection(dtype):
    # torchvision: x.transpose(1, 0) before the in-projection, its view(17, 1, 3, 64) after
    prog = linear_prog((1, 17, 64), ("transpose", (1, 0, 2)), 192, ("reshape", (17, 1, 3, 64)), dtype=dtype)
    ours = run_pass(PASS, prog)
    assert op_types(ours) == ["linear", "reshape", "relu"]
    assert ours.functions["main"].find_ops(op_type="linear")[0].x.name == "x"
    assert_programs_equivalent(prog, ours, rtol=1e-5 if dtype == types.fp32 else 1e-3)


def test_linear_out_projection():
    # torchvision: view(17, 64) before the out-projection, view(17, 1, 64) after
    prog = linear_prog((17, 1, 4, 16), ("reshape", (17, 64)), 64, ("reshape", (17, 1, 64)))
    ours = check_linear(prog, ["reshape", "linear", "relu"])
    assert ours.functions["main"].find_ops(op_type="linear")[0].outputs[0].name == "after"


def check_linear(prog: Program, expected: list[str]) -> Program:
    return check_new_pass(PASS, prog, expected, rtol=1e-5)


@pytest.mark.parametrize(
    ("shape", "before", "after"),
    [
        ((4, 8), ("transpose", (1, 0)), ("reshape", (40,))),  # neither keeps the last axis
        ((1, 17, 1, 64), ("reshape", (17, 64)), ("reshape", (17, 1, 1, 5))),  # linear over rank 4
    ],
    ids=["last_axis_moves", "rank_4"],
)
def test_linear_not_merged(shape, before, after):
    check_linear(linear_prog(shape, before, 5, after), [before[0], "linear", after[0], "relu"])


def test_linear_between_transposes_that_undo_each_other():
    prog = linear_prog((2, 3, 8), ("transpose", (1, 0, 2)), 5, ("transpose", (1, 0, 2)))
    ours = check_linear(prog, ["linear", "relu"])
    assert ours.functions["main"].find_ops(op_type="linear")[0].outputs[0].name == "after"
