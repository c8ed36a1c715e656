"""``generic::fuse_rms_norm``: RMSNorm written out into one ``l2_norm`` (with its rank padding) and a scale.

Math. RMSNorm over the last axis of ``x`` (``d = x.shape[-1]``)::

    y = x / sqrt(mean(x^2, -1) + e) * w

and ``mean(x^2) = sum(x^2) / d``, so, multiplying numerator and denominator by ``sqrt(d)``::

    y = sqrt(d) * x / sqrt(sum(x^2, -1) + d * e) * w = l2_norm(x, epsilon=d * e) * (sqrt(d) * w)

an identity of real numbers. MIL's ``l2_norm`` (iOS15) computes ``x / sqrt(sum(x^2) + epsilon)`` over
the *last three* axes, so ``x`` gets two trailing unit axes first (``expand_dims(axes=[-2, -1])``: the
last three axes are ``(d, 1, 1)``, the sum is over ``d`` alone) and loses them after
(``squeeze(axes=[-2, -1])``). Symbolic leading dimensions are fine; ``d`` must be known.

Core ML holds tensors of rank 5 at most, so ``x`` of rank 4 or 5 (Qwen3's and OLMo2's RMSNorm over each
head of ``q`` and ``k``, shape ``(batch, seq, heads, head_dim)``) cannot take two more axes: it is
``reshape``d to ``(-1, d, 1, 1)`` and back to its shape instead, the same 4 ops (from the input of
the ``reshape`` giving ``x``, when only the norm reads ``x``: a reshape of a reshape is one). That needs
every dimension of ``x`` known (the shape to go back to); a rank-4 or rank-5 ``x`` with a symbolic
dimension is left alone.

The epsilon ``e`` is the ``add``'s constant plus the ``rsqrt``'s own ``epsilon`` (``rsqrt(v, epsilon)``
is ``1 / sqrt(v + epsilon)``; the ``sqrt`` forms add nothing). Rounding: ``d * e`` and ``sqrt(d) * w``
are computed in float64 and rounded once to the program's dtype (for ``d`` a power of four, ``sqrt(d)``
is a power of two and ``sqrt(d) * w`` is exact); the rest is the reordering of a sum of squares, the
same float32 rounding as the original (the zoo's LLMs agree with PyTorch to ~3e-7 of the output scale,
override on or off).

Float16. Written out, ``x^2`` overflows float16 once ``|x| > 255.9`` (``x^2 > 65504``): ``mean`` is
``inf`` and the norm returns 0 for the whole row. ``l2_norm`` is one op: its sum of squares is not a
tensor of the program, so it is not rounded to float16 (the reference evaluator accumulates a single
op's reduction in float64, which models that; the runtime's own kernel cannot be run here). This is the
form executorch uses on the Neural Engine for that reason.

Spellings (``*`` = ``mul``; commutative operand orders are the matcher's business)::

    square:    x --> pow(2) ------|        or      x --> mul(x, x) --|
                                  v                                  v
                          reduce_mean(axes=[-1], keep_dims=True) --> add(e) --> inv_sqrt --> y0

    inv_sqrt, and how it meets x:
        "rsqrt":    --> rsqrt(epsilon) --> * x
        "div":      --> sqrt --> real_div(x, .)
        "recip":    --> sqrt --> real_div(1, .) --> * x
        "inverse":  --> sqrt --> inverse(epsilon=0) --> * x
        "rsqrt" also without the add (the epsilon already inside rsqrt)

    weight:  y = y0 * w  (any constant w: Llama's ``weight * x``, Gemma's ``x * (1 + w)`` once
             ``1 + w`` is folded), or y = y0 (no weight; a non-constant weight stays a ``mul`` after)

All twenty become::

    x --> expand_dims(axes=[-2, -1]) --> l2_norm(epsilon=d*e) --> squeeze(axes=[-2, -1]) --> * c --> y

    (x of rank 4 or 5, every dimension known:)
    x --> reshape(-1, d, 1, 1) --> l2_norm(epsilon=d*e) --> reshape(x.shape) --> * c --> y

with ``c = sqrt(d) * w`` (weighted) or ``sqrt(d)`` (unweighted): 4 ops where there were 5 to 7.

Left alone (each a test): a reduction over any axis but the last, or without ``keep_dims``; an exponent
other than 2; a non-constant or negative epsilon; the ``inverse`` form with a non-zero ``epsilon`` --
``1 / sqrt(x)`` converted from PyTorch is ``inverse(epsilon=1e-4)``, i.e. ``1 / (sqrt(v) + 1e-4)``,
which ``l2_norm`` cannot express (coremltools' own conversion differs from PyTorch there); an unknown
``d``; dtypes other than fp16 / fp32. ``torch.nn.functional.rms_norm`` is converted by coremltools
into a max-scaled form whose epsilon is multiplied by ``max|x|^2``: not RMSNorm, not matched.

The pass is new (coremltools has none), so it runs right after ``common::fuse_layernorm_or_instancenorm``
while ``ENABLE_EXPERIMENTAL_PASSES=1``: constants are folded (``1 + w`` of Gemma included) and
``add_fp16_cast`` has not yet run. Weighted patterns have priority over unweighted ones, so a constant
weight is always folded into the scale.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var, get_new_symbol

from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = [
    "INV_SQRT_FORMS",
    "SQUARE_FORMS",
    "rms_norm_constraints",
    "rms_norm_pattern",
    "transform_rms_norm",
]

SQUARE_FORMS: tuple[str, ...] = ("pow", "mul")
"""``pow(x, 2)`` or ``mul(x, x)``."""

INV_SQRT_FORMS: tuple[str, ...] = ("rsqrt", "rsqrt_no_add", "div", "recip", "inverse")
"""How ``1 / sqrt(mean + e)`` is written and applied to ``x`` (see the module docstring)."""

_SHAPE = [get_new_symbol(), get_new_symbol(), 8]


def rms_norm_pattern(square: str, inv_sqrt: str, weighted: bool) -> Program:
    """The pattern of one spelling.

    Args:
        square: One of :data:`SQUARE_FORMS`.
        inv_sqrt: One of :data:`INV_SQRT_FORMS`.
        weighted: Whether the pattern ends with ``mul`` by a weight (op ``weight``).

    Returns:
        The pattern, ops named ``square``, ``mean``, ``add_eps`` (unless ``rsqrt_no_add``), ``rsqrt`` or
        ``sqrt`` (+ ``recip`` / ``inverse``), ``normed`` (the op giving ``x / rms``), ``weight``.
    """

    def body(x: Var, w: Var | None) -> Var:
        sq = mb.pow(x=x, y=2.0, name="square") if square == "pow" else mb.mul(x=x, y=x, name="square")
        v = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean")
        if inv_sqrt != "rsqrt_no_add":
            v = mb.add(x=v, y=1e-6, name="add_eps")
        if inv_sqrt.startswith("rsqrt"):
            y = mb.mul(x=x, y=mb.rsqrt(x=v, name="rsqrt"), name="normed")
        elif inv_sqrt == "div":
            y = mb.real_div(x=x, y=mb.sqrt(x=v, name="sqrt"), name="normed")
        elif inv_sqrt == "recip":
            r = mb.real_div(x=1.0, y=mb.sqrt(x=v, name="sqrt"), name="recip")
            y = mb.mul(x=x, y=r, name="normed")
        else:
            r = mb.inverse(x=mb.sqrt(x=v, name="sqrt"), epsilon=0.0, name="inverse")
            y = mb.mul(x=x, y=r, name="normed")
        return y if w is None else mb.mul(x=y, y=w, name="weight")

    if weighted:

        @mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE), mb.TensorSpec(shape=(8,))])
        def rms_norm_weighted(x, w):
            return body(x, w)

        return rms_norm_weighted

    @mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
    def rms_norm(x):
        return body(x, None)

    return rms_norm


def _scalar(var: Var) -> float | None:
    """The value of a constant of size 1 that is not a constexpr, else None."""
    if not predicates.is_constant(var) or predicates.is_constexpr(var):
        return None
    value = np.asarray(var.val, dtype=np.float64)
    return float(value.reshape(())) if value.size == 1 else None


def _epsilon(pattern: Pattern) -> float | str:
    """``e``: the ``add``'s constant plus ``rsqrt``'s epsilon; the reason when it is not a usable one."""
    total = 0.0
    if "add_eps" in pattern.ops:
        eps = _scalar(pattern.operand("add_eps", "y"))
        if eps is None:
            return "the epsilon added is not a one-element constant"
        total += eps
    if "rsqrt" in pattern.ops:
        eps = _scalar(pattern.rsqrt.epsilon)
        if eps is None:
            return "rsqrt's epsilon is not a constant"
        total += eps
    if "inverse" in pattern.ops and _scalar(pattern.inverse.epsilon) != 0.0:
        return "inverse with a non-zero epsilon: 1 / (sqrt(v) + epsilon) is not an RMSNorm"
    if "recip" in pattern.ops and _scalar(pattern.recip.x) != 1.0:
        return f"the reciprocal's numerator is {_scalar(pattern.recip.x)}, not 1"
    if not (total >= 0.0 and math.isfinite(total)):
        return f"the epsilon is {total}, not a finite value >= 0"
    return total


_MAX_RANK = 5
"""The largest tensor rank Core ML holds."""


def rms_norm_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Square of 2, mean over the last axis kept, known ``d``, constant non-negative epsilon, fp16/fp32.

    Returns:
        True, or ``(False, reason)``.
    """
    x = pattern.root_vars[0] if "weight" in pattern.ops else pattern.root_var
    if x.rank is None or x.rank < 1:
        return False, "x of unknown rank or a scalar"
    if not predicates.dtype_is(x, "fp16", "fp32"):
        return False, "x is not fp16 or fp32"
    d = x.shape[-1]
    if not isinstance(d, (int, np.integer)) or d < 1:
        return False, f"the last dimension of x is {d}, not a known size"
    if x.rank > _MAX_RANK - 2 and not all(isinstance(n, (int, np.integer)) for n in x.shape):
        return False, f"x of rank {x.rank} with a symbolic dimension (reshaped, its shape must be known)"
    if pattern.square.op_type == "pow" and _scalar(pattern.square.y) != 2.0:
        return False, f"the exponent is {_scalar(pattern.square.y)}, not 2"
    mean = pattern.mean
    if not predicates.axes_are(mean.axes, x.rank, [x.rank - 1]):
        return False, f"the mean is over axes {predicates.value_of(mean.axes)}, not the last axis"
    if not predicates.attr_is(mean, "keep_dims", True):
        return False, "the mean does not keep its dimensions (keep_dims=False)"
    eps = _epsilon(pattern)
    if isinstance(eps, str):
        return False, eps
    if pattern.normed.outputs[0].shape != x.shape:
        return False, "the normalisation broadcasts x to another shape"
    if "weight" in pattern.ops:
        w = pattern.operand("weight", "y")
        if not predicates.is_constant(w) or predicates.is_constexpr(w) or w.dtype != x.dtype:
            return False, "the weight is not a constant of x's dtype"
    pattern.add_attribute("rms_x", x)
    pattern.add_attribute("rms_epsilon", int(d) * eps)
    pattern.add_attribute("rms_scale", math.sqrt(int(d)))
    return True


def _unreshaped(x: Var, pattern: Pattern) -> Var:
    """The input of the ``reshape`` giving ``x`` when only the match reads ``x`` (a reshape of a reshape is
    one reshape: coremltools' ``merge_consecutive_reshapes`` makes it one in a conversion, after this pass;
    a saved package optimized alone would keep both), else ``x``."""
    producer = x.op
    if producer is None or producer.op_type != "reshape" or producer.enclosing_block is not pattern.block:
        return x
    if any(user not in pattern.op_set for user in x.child_ops) or x.consuming_blocks:
        return x
    return producer.x


def transform_rms_norm(pattern: Pattern) -> None:
    """``squeeze(l2_norm(expand_dims(x), d * e)) * c`` before the last op, named after its output."""
    x: Var = pattern.rms_x
    last = pattern.final_op
    name = last.outputs[0].name
    scale: np.ndarray = np.asarray(pattern.rms_scale, dtype=np.float64)
    if "weight" in pattern.ops:
        scale = scale * np.asarray(pattern.operand("weight", "y").val, dtype=np.float64)
    if x.rank <= _MAX_RANK - 2:
        padded = mb.expand_dims(x=x, axes=[-2, -1], name=f"{name}_padded", before_op=last)
    else:
        padded = mb.reshape(
            x=_unreshaped(x, pattern), shape=[-1, x.shape[-1], 1, 1], name=f"{name}_padded", before_op=last
        )
    epsilon = pattern.const_like(pattern.rms_epsilon, like=x, before_op=last)
    normed = mb.l2_norm(x=padded, epsilon=epsilon, name=f"{name}_l2_norm", before_op=last)
    if x.rank <= _MAX_RANK - 2:
        unpadded = mb.squeeze(x=normed, axes=[-2, -1], name=f"{name}_unpadded", before_op=last)
    else:
        unpadded = mb.reshape(x=normed, shape=list(x.shape), name=f"{name}_unpadded", before_op=last)
    out = mb.mul(x=unpadded, y=pattern.const_like(scale, like=x, before_op=last), name=name, before_op=last)
    pattern.replace_output(out)


def _register() -> None:
    patterns = [
        rms_norm_pattern(square, inv_sqrt, weighted)
        for weighted, square, inv_sqrt in itertools.product((True, False), SQUARE_FORMS, INV_SQRT_FORMS)
    ]
    register_generic_pass(
        ops_arrangement=patterns,
        var_constraints=rms_norm_constraints,
        transform_pattern=transform_rms_norm,
        pass_name="fuse_rms_norm",
        namespace="generic",
        constants="const",
        name="rms_norm",
        run_after="common::fuse_layernorm_or_instancenorm",
    )


_register()
