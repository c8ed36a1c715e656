"""``common::fuse_gelu_tanh_approximation``: coremltools' two forms (same program) and the JAX-style cube.

The symbolic proof is done once per pattern (``test_pattern_equals_its_replacement_symbolically``):
sympy takes about a second per tanh GELU.
"""

from __future__ import annotations

import math

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.convert import convert_torch
from pattern_infra.testing.models import gelu_tanh_cube, gelu_tanh_pow
from pattern_infra.testing.passes import check_fused, check_not_fused, op_types, run_both, run_pass
from pattern_infra.verification.symbolic import prove_equivalent
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_gelu_tanh_approximation"
SHAPE = (2, 3, 4)
SQRT_2_OVER_PI = 0.7978845608028654


def _mul(a: Var, b: Var, swap: bool, **kw) -> Var:
    return mb.mul(x=b, y=a, **kw) if swap else mb.mul(x=a, y=b, **kw)


def _add(a: Var, b: Var, swap: bool, **kw) -> Var:
    return mb.add(x=b, y=a, **kw) if swap else mb.add(x=a, y=b, **kw)


def gelu_tanh(
    form: int = 1,
    cube: str = "pow",
    swap: bool = False,
    *,
    c: float = 0.044715,
    extra: str | None = None,
) -> Program:
    """Form 1: ``x * (0.5 * (1 + tanh(...)))``; form 2: ``(0.5 * x) * (1 + tanh(...))``.

    ``cube``: ``"pow"`` (``pow(x, 3)``), ``"xxx"`` (``(x * x) * x``) or ``"x_xx"`` (``x * (x * x)``).
    ``extra``: ``"use_square"`` (``x * x`` used elsewhere), ``"out_tanh"`` (``tanh`` is a block output),
    ``"use_root"`` (``x`` used elsewhere).
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE)])
    def prog(x):
        square = None
        if cube == "pow":
            x3 = mb.pow(x=x, y=3.0, name="pow")
        else:
            square = _mul(x, x, swap, name="square")
            x3 = _mul(square, x, swap ^ (cube == "x_xx"), name="cube")
        inner = _add(x, _mul(x3, c, swap, name="mul_1"), swap, name="add")
        tanh = mb.tanh(x=_mul(inner, SQRT_2_OVER_PI, swap, name="mul_2"), name="tanh")
        one_plus = _add(tanh, 1.0, swap, name="add_1")
        if form == 1:
            y = _mul(x, _mul(one_plus, 0.5, swap, name="mul"), swap, name="y")
        else:
            y = _mul(_mul(x, 0.5, swap, name="mul"), one_plus, swap, name="y")
        if extra == "use_square":
            return y, mb.exp(x=square)
        if extra == "out_tanh":
            return y, tanh
        if extra == "use_root":
            return y, mb.exp(x=x)
        return y

    return prog


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
@pytest.mark.parametrize("form", [1, 2])
def test_pow_forms_give_coremltools_program(form, swap):
    check_fused(PASS, gelu_tanh(form, "pow", swap), ["gelu"])


@pytest.mark.parametrize("swap", [False, True], ids=["xy", "yx"])
@pytest.mark.parametrize("cube", ["xxx", "x_xx"])
@pytest.mark.parametrize("form", [1, 2])
def test_jax_style_cube_is_fused_beyond_coremltools(form, cube, swap):
    prog = gelu_tanh(form, cube, swap)
    outcome = run_both(PASS, prog)
    assert op_types(outcome.coremltools) == op_types(prog)  # coremltools leaves it
    ours = check_fused(PASS, prog, ["gelu"], same_as_coremltools=False)
    (gelu,) = [op for op in ours.functions["main"].operations if op.op_type == "gelu"]
    assert gelu.mode.val == "TANH_APPROXIMATION" and gelu.outputs[0].name == "y"


@pytest.mark.parametrize("cube", ["pow", "xxx"])
def test_root_with_other_consumers_is_fused(cube):
    check_fused(PASS, gelu_tanh(2, cube, extra="use_root"), ["gelu", "exp"], same_as_coremltools=False)


@pytest.mark.parametrize(
    "cube, kwargs",
    [
        ("xxx", {"extra": "use_square"}),
        ("pow", {"extra": "out_tanh"}),
        ("xxx", {"extra": "out_tanh"}),
        ("pow", {"c": 0.05}),
        ("xxx", {"c": 0.05}),
    ],
    ids=[
        "square_used_elsewhere",
        "pow_tanh_is_block_output",
        "cube_tanh_is_block_output",
        "pow_wrong_constant",
        "cube_wrong_constant",
    ],
)
def test_not_fused(cube, kwargs):
    check_not_fused(PASS, gelu_tanh(1, cube, **kwargs))


def test_x_times_y_times_x_is_not_a_cube():
    """``(x * z) * x`` is not ``x ** 3``: the square must read the same variable twice."""

    @mb.program(input_specs=[mb.TensorSpec(shape=SHAPE), mb.TensorSpec(shape=SHAPE)])
    def prog(x, z):
        x3 = mb.mul(x=mb.mul(x=x, y=z), y=x)
        tanh = mb.tanh(x=mb.mul(x=mb.add(x=x, y=mb.mul(x=x3, y=0.044715)), y=SQRT_2_OVER_PI))
        return mb.mul(x=x, y=mb.mul(x=mb.add(x=tanh, y=1.0), y=0.5))

    assert op_types(run_pass(PASS, prog)) == op_types(prog)


@pytest.mark.parametrize("fn", [gelu_tanh_cube, gelu_tanh_pow], ids=["jax_cube", "pow"])
def test_convert_fuses_torch_tanh_gelus_under_the_override(fn):
    """The op chains torch.export + coremltools produce reach the pass and are fused."""

    class Gelu(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    args = (torch.randn(2, 8),)
    kwargs = {"minimum_deployment_target": ct.target.iOS17}
    plain = convert_torch(Gelu(), args, override=False, **kwargs)
    fused = convert_torch(Gelu(), args, override=True, **kwargs)
    assert op_types(fused) == ["gelu"]
    assert [op.mode.val for op in fused.functions["main"].operations if op.op_type == "gelu"] == [
        "TANH_APPROXIMATION"
    ]
    assert_programs_equivalent(plain, fused, rtol=1e-5)
    if fn is gelu_tanh_pow:
        assert op_types(plain) == ["gelu"]
    else:
        assert "gelu" not in op_types(plain)


def test_the_patterns_require_the_float32_value_of_sqrt_2_over_pi():
    """Every registered GELU pattern requires sqrt(2 / pi) where GELU has it (the value rule, read from
    the compiled patterns), and a program off by 2e-3 there (twice the tolerance, coremltools' own) is left
    alone."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    expected = np.float32(math.sqrt(2 / math.pi))
    for sub in PASS_REGISTRY[PASS].passes:
        values = [
            v for _, v, rule in sub.compiled.consts if rule.mode == "value" and v is not None and v.size == 1
        ]
        near = [float(v) for v in values if abs(float(v) - 0.8) < 0.01]
        assert near and all(np.float32(v) == expected for v in near), (sub.name, near)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def off(x):
        inner = mb.mul(x=mb.add(x=x, y=mb.mul(x=mb.pow(x=x, y=3.0), y=0.044715)), y=float(expected) + 2e-3)
        return mb.mul(x=mb.mul(x=mb.add(x=mb.tanh(x=inner), y=1.0), y=0.5), y=x)

    assert "gelu" not in op_types(run_pass(PASS, off))


@pytest.mark.parametrize(
    "form, cube", [(1, "pow"), (2, "pow"), (1, "xxx"), (2, "xxx")], ids=["pow_1", "pow_2", "cube_1", "cube_2"]
)
def test_pattern_equals_its_replacement_symbolically(form, cube):
    # each spelling of each pattern (the patterns hold both cubes as a choice, so they are no program
    # of one spelling themselves)
    pattern = gelu_tanh(form, cube)
    fused = run_pass(PASS, pattern)
    assert op_types(fused) == ["gelu"]
    assert (proof := prove_equivalent(pattern, fused)).proven, proof
