"""``common::fuse_layernorm_or_instancenorm``: normalisations written out op by op into one op.

Math: over the reduced axes ``A`` of ``x``, with ``mean = E_A[x]``, ``d = x - mean``, ``var = E_A[d^2]``,

    layer_norm(x, axes=A, gamma, beta, eps) = gamma * d / sqrt(var + eps) + beta

reached by many association orders, all used by converted models. Six patterns (``v = var + eps``;
operand order of commutative ops never matters, the matcher tries both)::

    1 (TF BERT, folded)   y = x * k + (beta - mean * k),       k = rsqrt(v) * gamma
    3 (TF-Addons)         y = x * r + (mean * r) * -1,         r = rsqrt(v)
    4 (E[x^2] - E[x]^2)   as 1, with mean = reduce_sum(x) * (1/N) and var = E[x^2] - mean^2
    5 (ml-ane BC1S)       y = (d * rsqrt(v) + beta) * gamma,   axes exactly [1]
    written out, sub1     y = [gamma *] NORM(d [* gamma]) [+ beta]     (one op computes d)
    written out, sub2     the same, the numerator a second sub(x, mean) (what torch.export gives)

        x --> reduce_mean = mean --> sub(x, mean) = d --> SQUARE(d) --> reduce_mean --> add(eps) = v
        NORM(n) = real_div(n, sqrt(v)) | real_div(n, pow(v, 0.5)) | mul(n, rsqrt(v))
        SQUARE(d) = pow(d, 2) | mul(d, d) | square(d)

The written-out patterns are 2 x 3 x 3 x 3 x 2 = 108 spellings (coremltools' pattern 2 and pattern 5
without affine among them) declared with ``one_of``/``optional`` (:mod:`pattern_infra.language.choices`): the
square, the normaliser, gamma after / before / absent, beta present or not. Gamma and beta are
``fallback`` choices: the spelling with them is offered first, and when the constraints refuse it (a
gamma acting along another axis, ...) the one without, so that gamma or beta stays an op after the fused
norm instead of blocking the fusion. Patterns 1, 3, 4, 5 run first (longest first), then the written-out
ones (a pattern-5 program's ``d * rsqrt(v) + beta`` is a written-out spelling). Pattern 4 is a sub-pass
of its own; the others are one pattern whose spellings are their programs' (in this order), searched
from the ``reduce_mean`` they all have.

Every pattern becomes one op (or, for an NHWC instance norm, a transpose sandwich); which op, and the
checks coremltools lacks, are in :mod:`generic_passes._norm_plan`::

        x --> layer_norm(axes, gamma, beta, eps) --> y
        x --> instance_norm(gamma, beta, eps) --> y                                   (rank 4, axes [-2, -1])
        x --> transpose(0,3,1,2) --> instance_norm --> transpose(0,2,3,1) --> y       (rank 4, axes [-3, -2])

Beyond coremltools: ``x`` may have other consumers (pre-norm residual stream); child order, operand order
and the ``mul(-1)`` operand position never matter; the written-out spellings; gamma/beta of any shape
acting along the normalised axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var, get_new_symbol

from pattern_infra import ConstRule, Pattern, register_generic_pass
from pattern_infra.language.choices import one_of, optional

from ._norm_plan import (
    constraints_1,
    constraints_3,
    constraints_4,
    constraints_5_affine,
    constraints_written_out,
    transform_norm,
)

__all__ = ["PASS_NAME", "PATTERNS", "written_out_pattern"]

PASS_NAME = "fuse_layernorm_or_instancenorm"

_RANK3 = [get_new_symbol(), get_new_symbol(), get_new_symbol()]
_RANK4 = [get_new_symbol(), get_new_symbol(), get_new_symbol(), get_new_symbol()]
_GAMMA = np.float32(1.5)  # placeholders: the pattern only demands "a compile-time constant" there
_BETA = np.float32(0.5)
_EPS = np.float32(1e-5)

_EXACT = ConstRule("value", rtol=0.0, atol=0.0)
_ISCLOSE = ConstRule("value", rtol=1e-5, atol=1e-8)  # np.isclose's defaults, as coremltools checks pow(0.5)


def _variance(x: Var, axes: list[int], square: Callable[[Var], Var]) -> tuple[Var, Var, Var]:
    """``mean``, ``d = x - mean`` and ``v = reduce_mean(square(d)) + eps`` (ops ``mean``, ``sub``,
    ``mean_sq``, ``add_eps``; ``square`` names its own)."""
    mean = mb.reduce_mean(x=x, axes=axes, keep_dims=True, name="mean")
    d = mb.sub(x=x, y=mean, name="sub")
    mean_sq = mb.reduce_mean(x=square(d), axes=axes, keep_dims=True, name="mean_sq")
    return mean, d, mb.add(x=mean_sq, y=_EPS, name="add_eps")


def _folded_tail(x: Var, mean: Var, k: Var, shift: Callable[[Var], Var]) -> Var:
    """``x * k + shift(mean * k)`` (ops ``mul_x``, ``mul_mean``, ``add_out``)."""
    mul_x = mb.mul(x=x, y=k, name="mul_x")
    return mb.add(x=mul_x, y=shift(mb.mul(x=mean, y=k, name="mul_mean")), name="add_out")


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def layernorm_pattern_1(x):
    mean, _, v = _variance(x, [2, 3], lambda d: mb.square(x=d, name="square"))
    k = mb.mul(x=mb.rsqrt(x=v, name="rsqrt"), y=_GAMMA, name="mul_gamma")
    return _folded_tail(x, mean, k, lambda m: mb.sub(x=_BETA, y=m, name="sub_beta"))


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def instancenorm_pattern_3(x):
    mean, _, v = _variance(x, [2, 3], lambda d: mb.square(x=d, name="square"))
    r = mb.rsqrt(x=v, name="rsqrt")
    return _folded_tail(x, mean, r, lambda m: mb.mul(x=m, y=np.float32(-1.0), name="mul_neg"))


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def instancenorm_pattern_4(x):
    sum_sq = mb.reduce_sum(x=mb.mul(x=x, y=x, name="mul_sq_x"), axes=[2, 3], keep_dims=True, name="sum_sq")
    mean_sq = mb.mul(x=sum_sq, y=np.float32(0.25), name="mean_sq")
    sum_x = mb.reduce_sum(x=x, axes=[2, 3], keep_dims=True, name="sum_x")
    mean = mb.mul(x=sum_x, y=np.float32(0.25), name="mean")
    var = mb.sub(x=mean_sq, y=mb.mul(x=mean, y=mean, name="mul_sq_mean"), name="sub_var")
    k = mb.mul(x=mb.rsqrt(x=mb.add(x=var, y=_EPS, name="add_eps"), name="rsqrt"), y=_GAMMA, name="mul_gamma")
    return _folded_tail(x, mean, k, lambda m: mb.sub(x=_BETA, y=m, name="sub_beta"))


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def layernorm_pattern_5_affine(x):
    _, d, v = _variance(x, [1], lambda d: mb.mul(x=d, y=d, name="square"))
    out = mb.add(x=mb.mul(x=d, y=mb.rsqrt(x=v, name="std"), name="normalize"), y=_BETA, name="add_beta")
    return mb.mul(x=out, y=_GAMMA, name="mul_gamma")


def written_out_pattern(subs: Literal["sub1", "sub2"], square: Literal["mul", "pow_or_square"]) -> Program:
    """The written-out spellings with one ``x - mean`` (``"sub1"``) or a second one for the numerator
    (``"sub2"``, op ``sub_num``); ``d^2`` as ``mul(d, d)`` or as ``pow(d, 2)`` | ``square(d)`` (a choice
    reads ``d`` equally often in each alternative). Other ops: ``mean``, ``sub``, ``square``,
    ``mean_sq``, ``add_eps``, ``std``, ``normalize``, ``mul_gamma`` and ``add_beta`` when present;
    ``pattern.choices`` says which spelling matched (``squared``, ``normalized``, ``gamma``: 0 after, 1
    before, 2 none; ``beta``: 0 with, 1 without)."""

    def squared(d: Var) -> Var:
        if square == "mul":
            return mb.mul(x=d, y=d, name="square")
        return one_of(
            "squared",
            lambda: mb.pow(x=d, y=np.float32(2.0), name="square"),
            lambda: mb.square(x=d, name="square"),
        )

    @mb.program(input_specs=[mb.TensorSpec(shape=_RANK3)])
    def pattern(x):
        mean, d, v = _variance(x, [-1], squared)
        num = d if subs == "sub1" else mb.sub(x=x, y=mean, name="sub_num")

        def normalized(n: Var) -> Var:
            return one_of(
                "normalized",
                lambda: mb.real_div(x=n, y=mb.sqrt(x=v, name="std"), name="normalize"),
                lambda: mb.real_div(x=n, y=mb.pow(x=v, y=np.float32(0.5), name="std"), name="normalize"),
                lambda: mb.mul(x=n, y=mb.rsqrt(x=v, name="std"), name="normalize"),
            )

        def scaled() -> Var:
            return one_of(
                "gamma",
                lambda: mb.mul(x=_GAMMA, y=normalized(num), name="mul_gamma"),
                lambda: normalized(mb.mul(x=_GAMMA, y=num, name="mul_gamma")),
                lambda: normalized(num),
                fallback=True,
            )

        return optional("beta", scaled, lambda n: mb.add(x=n, y=_BETA, name="add_beta"), fallback=True)

    return pattern


PATTERNS: dict[str, tuple[Program, Callable[[Pattern], bool | tuple[bool, str]]]] = {
    "instancenorm_pattern_4": (instancenorm_pattern_4, constraints_4),
    "layernorm_pattern_1": (layernorm_pattern_1, constraints_1),
    "instancenorm_pattern_3": (instancenorm_pattern_3, constraints_3),
    "layernorm_pattern_5_affine": (layernorm_pattern_5_affine, constraints_5_affine),
    **{
        f"written_out_{subs}_{square}": (written_out_pattern(subs, square), constraints_written_out)
        for subs in ("sub2", "sub1")
        for square in ("pow_or_square", "mul")
    },
}
"""The patterns, in the order they are tried (longest first: a shorter pattern only takes what a longer
one left), with their constraints."""

# pow(d, 2.0000001) is NaN for d < 0; coremltools checks pow(v, 0.5) with np.isclose; each rule applies
# where a pattern has that constant (a written-out pow or sqrt, pattern 3's -1)
_RULES = {"square.y": _EXACT, "std.y": _ISCLOSE, "mul_neg.y": _EXACT}
_FIRST = "instancenorm_pattern_4"  # its own sub-pass: it shares no rare op name with the others
for _priority, _names in ((1, [_FIRST]), (0, [name for name in PATTERNS if name != _FIRST])):
    register_generic_pass(
        ops_arrangement={name: PATTERNS[name][0] for name in _names},
        var_constraints=lambda pattern: PATTERNS[pattern.pattern_name][1](pattern),
        transform_pattern=transform_norm,
        pass_name=PASS_NAME,
        namespace="common",
        constants="const",
        const_rules={k: v for k, v in _RULES.items() if _FIRST not in _names},
        priority=_priority,
        name=_names[0] if len(_names) == 1 else "layer_norm",
    )
