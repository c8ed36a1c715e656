"""``generic::fuse_group_norm``: group norms written out, between their reshapes, into ``layer_norm`` or
``instance_norm``.

Math. A group norm of ``x`` of shape ``(N, C, *S)`` with ``G`` groups normalises each sample's groups of
``C / G`` channels over the channels and space they hold, then applies a per-channel affine::

    xr = reshape(x, (N, G, C/G, *S));  A = axes 2 .. rank(xr) - 1
    n  = (xr - E_A[xr]) / sqrt(E_A[(xr - E_A[xr])^2] + e)           (or * rsqrt(.., epsilon=e'): e + e')
    y  = reshape(n, x.shape) * gamma[c] + beta[c]                   (or batch_norm: per-channel too)

Three group counts make one op of MIL from it, all identities of real numbers:

* ``G = 1``: the one group is the whole sample, so ``n`` reshaped back is ``layer_norm(x, axes=[1..])``
  over ``C`` and space (timm's ``GroupNorm1`` of poolformer, mobilevitv2, efficientformer). The
  affine is per channel, and ``layer_norm``'s gamma has the normalised shape ``(C, *S)``: folding it
  would repeat each weight over ``prod(S)`` positions, so it stays after (``fuse_elementwise_to_batchnorm``
  makes it a ``batch_norm``); it is folded only where that repeats nothing (``gamma`` already of the
  normalised size).
* ``G = C``: each group is one channel, ``n`` reshaped back is ``instance_norm(x)`` (rank 3 or 4), whose
  ``gamma`` and ``beta`` are per channel: the affine goes inside (``y = n * s + t``; a ``batch_norm``
  after is ``s = gamma / sqrt(var + eps)``, ``t = beta - mean * s``, computed in float64 and rounded
  once to the program's dtype).
* any other ``G``: ``layer_norm(xr, axes=A)`` between the two reshapes, the affine after.

The same normalisation written on a rank-4 ``x`` without reshapes (a hand-written group norm, or a
converter that left them out) is ``layer_norm`` over ``[1, 2, 3]`` (the affine as for ``G = 1``) or
``instance_norm`` over ``[2, 3]`` (the affine inside). This pass takes such an ``instance_norm`` only
with its affine absorbed (one op); the rest goes to ``common::fuse_layernorm_or_instancenorm`` first, and
a second pass, ``generic::fuse_group_norm_unreshaped``, right after it, takes what that pass leaves (the
numerator with its own mean, the ``rsqrt`` whose ``add`` is folded). Where both could take a
``layer_norm`` over ``[1, 2, 3]``, the layer-norm pass's one op (its gamma repeated over the spatial
positions) is kept, against this pass's ``layer_norm`` and the affine after it. Other axes are the
layer-norm pass's alone.

Spellings of the normalisation (``m = reduce_mean(xr, A, keep_dims=True)``, each ``reduce_mean`` over
the same axes; commutative operand orders are the matcher's business)::

    xr --> m --> sub(xr, m) = d --> SQUARE(d) --> reduce_mean --> add(e) = v --> NORM(num, v) --> n

    SQUARE(d) = square(d) | pow(d, 2) | mul(d, d)
    NORM(num, v) = real_div(num, sqrt(v)) | mul(num, rsqrt(v))
             | mul(num, rsqrt(mean_sq, epsilon=e))    (no add: the epsilon folded into rsqrt)
    num = d                                  (one subtraction: a saved package, after CSE)
        | sub(xr, m)                         (the numerator subtracted again: torch.export)
        | sub(xr, reduce_mean(xr, A))        (its own mean too: coremltools' group_norm, before CSE)

and the affine after it, tried longest first and dropped when the plan cannot hold it (it then stays an
op after the fused norm)::

    AFFINE(y) = add(mul(y, gamma), beta) | batch_norm(y, mean, var, gamma, beta) | mul(y, gamma)
              | add(y, beta) | y

Before, coremltools' ``group_norm`` conversion (9 ops and its affine; ``G = 4``, 16 channels)::

    x --> reshape(2,4,4,8,8) --> reduce_mean -----------------> sub --> real_div --> reshape(2,16,8,8)
                 |--> reduce_mean --> sub --> square --> reduce_mean --> add(e) --> sqrt --^   |
                                                                                            v
                                                                   mul(gamma) --> add(beta) --> y

After::

    G = 1:      x --> layer_norm(axes=[1, 2, 3], e) --> mul(gamma) --> add(beta) --> y
    G = C:      x --> instance_norm(gamma, beta, e) --> y
    other G:    x --> reshape(N, G, C/G, H, W) --> layer_norm(axes=[2, 3, 4], e) --> reshape(N, C, H, W)
                  --> mul(gamma) --> add(beta) --> y

Left alone (each a test): reductions over differing axes or without ``keep_dims``; a reshape that does
more than split the channel axis (or whose shape is not a constant: symbolic spatial sizes); a non-constant
or negative epsilon; an exponent other than 2; a normalisation that broadcasts to another shape; dtypes
other than fp16 / fp32. A gamma or beta that is not per channel is not folded into ``instance_norm``: it
stays an op after it.

The pass is new (coremltools has none) and runs, override on, right after
``common::fuse_onehot_matmul_to_gather``: before ``common::fuse_layernorm_or_instancenorm`` (which would
take the normalisation between the reshapes and leave the reshapes and affine) and before
``common::fuse_elementwise_to_batchnorm`` (which would make the affine a ``batch_norm``, the form a saved
package has, also matched).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var, get_new_symbol
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra import ConstRule, Pattern, one_of, predicates, register_generic_pass

__all__ = [
    "AFFINE_FORMS",
    "INV_FORMS",
    "NUMERATOR_FORMS",
    "SQUARE_FORMS",
    "group_norm_constraints",
    "group_norm_pattern",
    "transform_group_norm",
]

NUMERATOR_FORMS: tuple[str, ...] = ("shared", "sub2", "own_mean")
"""The numerator: ``d`` itself, ``sub(xr, m)`` again, ``sub(xr, reduce_mean(xr))`` (see the docstring)."""

SQUARE_FORMS: tuple[str, ...] = ("square", "pow", "mul")
"""``square(d)``, ``pow(d, 2)`` or ``mul(d, d)``."""

INV_FORMS: tuple[str, ...] = ("div", "rsqrt", "rsqrt_eps")
"""``real_div(num, sqrt(v))``, ``mul(num, rsqrt(v))``, or ``mul(num, rsqrt(mean_sq, epsilon=e))`` with no
``add``: ``generic::fold_add_into_epsilon``'s form, which runs before the unreshaped pass."""

AFFINE_FORMS: tuple[str, ...] = ("mul_add", "batch_norm", "mul", "add")
"""The affine after the norm when there is one (alternatives of the ``affine_op`` choice, in order)."""

_PLACEHOLDER = np.float32(0.5)  # the pattern only demands "a compile-time constant" at these slots
_VEC = np.ones((1,), dtype=np.float32)


def _normalization(source: Callable[[], Var], axes: list[int], numerator: str, square: str, inv: str) -> Var:
    """One spelling of ``n`` of ``xr = source()`` (ops ``mean``, ``sub``, ``square``, ``mean_sq``,
    ``add_eps``, ``std``, ``normalize``, and ``sub_num`` / ``mean_num`` for the numerators that have them)."""
    xr = source()
    mean = mb.reduce_mean(x=xr, axes=axes, keep_dims=True, name="mean")
    d = mb.sub(x=xr, y=mean, name="sub")
    if square == "square":
        sq = mb.square(x=d, name="square")
    elif square == "pow":
        sq = mb.pow(x=d, y=np.float32(2.0), name="square")
    else:
        sq = mb.mul(x=d, y=d, name="square")
    mean_sq = mb.reduce_mean(x=sq, axes=axes, keep_dims=True, name="mean_sq")
    v = mean_sq if inv == "rsqrt_eps" else mb.add(x=mean_sq, y=_PLACEHOLDER, name="add_eps")
    if numerator == "shared":
        num = d
    elif numerator == "sub2":
        num = mb.sub(x=xr, y=mean, name="sub_num")
    else:
        num = mb.sub(x=xr, y=mb.reduce_mean(x=xr, axes=axes, keep_dims=True, name="mean_num"), name="sub_num")
    if inv == "div":
        return mb.real_div(x=num, y=mb.sqrt(x=v, name="std"), name="normalize")
    return mb.mul(x=num, y=mb.rsqrt(x=v, name="std"), name="normalize")


def _normalized(source: Callable[[], Var], axes: list[int]) -> Var:
    """Every spelling of ``n`` as one choice, the whole normalisation inside it: the spellings read
    ``xr``, ``mean`` and ``d`` a different number of times."""
    return one_of(
        "normalized",
        *(
            (lambda forms=forms: _normalization(source, axes, *forms))
            for forms in itertools.product(NUMERATOR_FORMS, SQUARE_FORMS, INV_FORMS)
        ),
    )


def _affine(y: Var) -> Var:
    """The affine after ``y`` (choice ``affine_op``; ops ``mul_gamma``, ``add_beta``, ``batch_norm``)."""
    return one_of(
        "affine_op",
        lambda: mb.add(x=mb.mul(x=y, y=_PLACEHOLDER, name="mul_gamma"), y=_PLACEHOLDER, name="add_beta"),
        lambda: mb.batch_norm(
            x=y, mean=_VEC, variance=_VEC, gamma=_VEC, beta=_VEC, epsilon=_PLACEHOLDER, name="batch_norm"
        ),
        lambda: mb.mul(x=y, y=_PLACEHOLDER, name="mul_gamma"),
        lambda: mb.add(x=y, y=_PLACEHOLDER, name="add_beta"),
        fallback=True,
    )


def group_norm_pattern(grouped: bool, affine: bool) -> Program:
    """One of the four patterns: with the reshapes around the normalisation (``grouped``: ops
    ``reshape_in``, ``reshape_out``) or on ``x`` itself; ending with the affine (``affine``: choice
    ``affine_op``) or not.

    The affine is a pattern of its own, not an ``optional``: every op of the pattern lies inside a
    choice, so the choice would be the search's anchor, where the shorter spelling of a ``fallback``
    choice is not offered inside a longer one's match. The affine patterns run first; where the
    constraints refuse the affine, the pattern without it fuses the norm and leaves the affine an op.
    """

    def body(x: Var) -> Var:
        if not grouped:
            return _normalized(lambda: x, [2, 3])
        n = _normalized(lambda: mb.reshape(x=x, shape=[1, 1, 1, 1, -1], name="reshape_in"), [2, 3, 4])
        return mb.reshape(x=n, shape=[1, 1, 1, -1], name="reshape_out")

    @mb.program(input_specs=[mb.TensorSpec(shape=[get_new_symbol() for _ in range(4)])])
    def group_norm(x):
        return _affine(body(x)) if affine else body(x)

    return group_norm


# -- what a match computes, and which op it becomes ----------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    """The replacement: ``kind`` of ``x`` over ``axes`` with ``epsilon``, and the affine folded into it."""

    kind: Literal["layer_norm", "instance_norm", "grouped"]
    x: Var
    """The input of the fused op: the original ``x`` (the reshapes dropped) or ``xr`` (``grouped``)."""
    axes: list[int]
    """The axes of ``x`` a ``layer_norm`` normalises (unused by ``instance_norm``)."""
    epsilon: float
    """The add's epsilon plus rsqrt's own."""
    gamma: np.ndarray | None = None
    """The folded scale (``[C]`` for ``instance_norm``, the normalised shape for ``layer_norm``)."""
    beta: np.ndarray | None = None
    """The folded shift, shaped as ``gamma``."""


def _static(shape: tuple) -> bool:
    return all(not is_symbolic(d) for d in shape)


def _same_dims(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(bool(p == q) for p, q in zip(a, b))


def _scalar(var: Var | None) -> float | None:
    """The value of a one-element constant that is not a constexpr, else None."""
    if var is None or not predicates.is_constant(var) or predicates.is_constexpr(var):
        return None
    value = np.asarray(predicates.value_of(var), dtype=np.float64)
    return float(value.reshape(())) if value.size == 1 else None


def _epsilon(pattern: Pattern) -> float | str:
    """``e``: the ``add``'s constant plus ``rsqrt``'s epsilon, or why it is not a usable one."""
    eps = _scalar(pattern.operand("add_eps", "y")) if "add_eps" in pattern.ops else 0.0
    if eps is None:
        return "the epsilon added is not a one-element constant"
    if pattern.std.op_type == "rsqrt":
        inner = _scalar(pattern.std.epsilon)
        if inner is None:
            return "rsqrt's epsilon is not a constant"
        eps += inner
    if not (eps >= 0.0 and math.isfinite(eps)):
        return f"the epsilon is {eps}, not a finite value >= 0"
    return eps


def _reduced_axes(pattern: Pattern, rank: int) -> list[int] | str:
    """The axes every ``reduce_mean`` of the match reduces (all the same, kept), or why not."""
    found: list[int] | None = None
    for name in ("mean", "mean_sq", "mean_num"):
        if name not in pattern.ops:
            continue
        op = getattr(pattern, name)
        if not predicates.attr_is(op, "keep_dims", True):
            return f"{name} does not keep its dimensions"
        value = predicates.value_of(op.axes)
        if value is None:
            return f"{name}'s axes are not constant"
        listed = [int(a) for a in np.atleast_1d(value)]
        axes = sorted({a % rank for a in listed if -rank <= a < rank})
        if len(axes) != len(listed):
            return f"{name}'s axes {listed} are not distinct axes of a rank-{rank} tensor"
        if found is not None and axes != found:
            return f"the reductions differ in axes ({found} and {axes})"
        found = axes
    return found if found is not None else "no reduction"  # every spelling has "mean"


def _grouped_plan(x: Var, xr: Var, axes: list[int], pattern: Pattern) -> _Plan | str:
    """``x`` (N, C, *S) reshaped to ``xr`` (N, G, C/G, *S) and back, normalised over axes 2.. of ``xr``."""
    xs, rs = tuple(x.shape), tuple(xr.shape)
    if len(xs) < 3 or len(rs) != len(xs) + 1 or not _static(xs) or not _static(rs):
        return f"reshape from {xs} to {rs}: not (N, C, *S) to (N, G, C/G, *S) of known sizes"
    if rs[0] != xs[0] or rs[1] * rs[2] != xs[1] or rs[3:] != xs[2:]:
        return f"reshape from {xs} to {rs} does more than split the channels into groups"
    if axes != list(range(2, len(rs))):
        return f"the group norm reduces axes {axes} of {rs}, not the group's channels and space"
    if not _same_dims(tuple(pattern.reshape_out.outputs[0].shape), xs):
        return "the second reshape does not restore x's shape"
    groups, channels = int(rs[1]), int(xs[1])
    if groups == 1:
        return _Plan("layer_norm", x, list(range(1, len(xs))), 0.0)
    if groups == channels and len(xs) in (3, 4):
        return _Plan("instance_norm", x, [], 0.0)
    return _Plan("grouped", xr, axes, 0.0)


def _plain_plan(x: Var, axes: list[int]) -> _Plan | str:
    rank = x.rank
    if rank == 4 and axes == [1, 2, 3]:
        return _Plan("layer_norm", x, axes, 0.0)
    if rank == 4 and axes == [2, 3]:
        return _Plan("instance_norm", x, axes, 0.0)
    return f"axes {axes} of a rank-{rank} x: not a group norm (common::fuse_layernorm_or_instancenorm's)"


def _affine_effect(pattern: Pattern) -> tuple[np.ndarray | None, np.ndarray | None] | str:
    """The affine after the norm as a scale and a shift (float64, right-aligned against the norm's output;
    None for one it does not apply), or why it cannot be read."""
    ops = pattern.ops
    if "batch_norm" in ops:
        bn = pattern.batch_norm
        values = [predicates.value_of(getattr(bn, s)) for s in ("mean", "variance", "gamma", "beta")]
        eps = _scalar(bn.epsilon)
        if eps is None or any(v is None for v in values) or bn.x.rank < 2:
            return "the batch_norm's parameters are not constants"
        mean, var, gamma, beta = (np.asarray(v, dtype=np.float64).reshape(-1) for v in values)
        scale = gamma / np.sqrt(var + eps)
        shape = (-1,) + (1,) * (bn.x.rank - 2)
        return scale.reshape(shape), (beta - mean * scale).reshape(shape)
    effect: list[np.ndarray | None] = []
    for name in ("mul_gamma", "add_beta"):
        if name not in ops:
            effect.append(None)
            continue
        var = pattern.operand(name, "y")
        if predicates.is_constexpr(var) or var.dtype != pattern.root_var.dtype:
            return f"{name}'s constant is not a constant of x's dtype"
        effect.append(np.asarray(predicates.value_of(var), dtype=np.float64))
    return effect[0], effect[1]


def _per_channel(value: np.ndarray, shape: tuple) -> np.ndarray | str:
    """``value`` as ``[C]`` for an ``instance_norm`` of ``x`` of ``shape``, or why it is not per channel."""
    rank = len(shape)
    if value.ndim > rank:
        return f"an affine constant of rank {value.ndim} over a rank-{rank} norm"
    padded = value.reshape((1,) * (rank - value.ndim) + value.shape)
    if any(padded.shape[a] != 1 for a in range(rank) if a != 1):
        return f"the affine constant of shape {value.shape} is not per channel"
    if is_symbolic(shape[1]) or padded.shape[1] not in (1, int(shape[1])):
        return f"the affine constant of shape {value.shape} does not fit {shape[1]} channels"
    return np.broadcast_to(padded.reshape(-1), (int(shape[1]),))


def _normalized_shape(value: np.ndarray, shape: tuple) -> np.ndarray | str:
    """``value`` as ``layer_norm``'s gamma or beta (of ``shape[1:]``), when that repeats nothing."""
    rank, normalized = len(shape), shape[1:]
    if value.ndim > rank or not _static(normalized):
        return f"an affine constant of shape {value.shape} over a norm of shape {shape}"
    padded = value.reshape((1,) * (rank - value.ndim) + value.shape)
    if tuple(padded.shape[1:]) != tuple(int(d) for d in normalized) or padded.shape[0] != 1:
        return f"folding the affine of shape {value.shape} into layer_norm would repeat it: kept after"
    return padded[0]


def _fold(plan: _Plan, pattern: Pattern) -> str | None:
    """Puts the affine into ``plan`` (gamma, beta), or says why the plan cannot hold it."""
    shape = tuple(plan.x.shape)
    if plan.kind == "grouped":
        return "a grouped layer_norm cannot hold a per-channel affine: kept after"
    if not _same_dims(tuple(pattern.final_op.outputs[0].shape), shape):
        return "the affine broadcasts the norm to another shape"
    effect = _affine_effect(pattern)
    if isinstance(effect, str):
        return effect
    fit = _per_channel if plan.kind == "instance_norm" else _normalized_shape
    folded: list[np.ndarray | None] = []
    for value in effect:
        if value is None:
            folded.append(None)
            continue
        result = fit(value, shape)
        if isinstance(result, str):
            return result
        folded.append(result)
    gamma, beta = folded
    if gamma is None and beta is not None:
        gamma = np.ones_like(beta)  # layer_norm's type inference checks beta against gamma's shape
    plan.gamma, plan.beta = gamma, beta
    return None


def group_norm_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Same axes kept by every reduction, an exponent of 2, a constant epsilon >= 0, shapes that make a
    group norm, an affine the chosen op can hold (else the spelling without it is tried).

    Returns:
        True, or ``(False, reason)``.
    """
    x = pattern.root_var
    if x.rank is None or not predicates.dtype_is(x, "fp16", "fp32"):
        return False, "x is not an fp16 or fp32 tensor of known rank"
    xr = pattern.mean.x
    if "square" in pattern.ops and pattern.square.op_type == "pow" and _scalar(pattern.square.y) != 2.0:
        return False, f"the exponent is {_scalar(pattern.square.y)}, not 2"
    axes = _reduced_axes(pattern, xr.rank)
    if isinstance(axes, str):
        return False, axes
    eps = _epsilon(pattern)
    if isinstance(eps, str):
        return False, eps
    if not _same_dims(tuple(pattern.normalize.outputs[0].shape), tuple(xr.shape)):
        return False, "the normalisation broadcasts to another shape"
    plan = _grouped_plan(x, xr, axes, pattern) if "reshape_in" in pattern.ops else _plain_plan(x, axes)
    if isinstance(plan, str):
        return False, plan
    plan.epsilon = eps
    if any(name in pattern.ops for name in ("mul_gamma", "add_beta", "batch_norm")):
        why = _fold(plan, pattern)
        if why is not None:
            return False, why
    pattern.add_attribute("group_norm_plan", plan)
    return True


def transform_group_norm(pattern: Pattern) -> None:
    """The planned ``layer_norm`` / ``instance_norm`` before the last op, named after its output."""
    plan: _Plan = pattern.group_norm_plan
    last = pattern.final_op
    name = last.outputs[0].name
    like = plan.x
    epsilon = pattern.const_like(plan.epsilon, like=like, before_op=last)
    gamma = None if plan.gamma is None else pattern.const_like(plan.gamma, like=like, before_op=last)
    beta = None if plan.beta is None else pattern.const_like(plan.beta, like=like, before_op=last)
    if plan.kind == "instance_norm":
        out = mb.instance_norm(x=plan.x, gamma=gamma, beta=beta, epsilon=epsilon, name=name, before_op=last)
    elif plan.kind == "layer_norm":
        out = mb.layer_norm(
            x=plan.x, axes=plan.axes, gamma=gamma, beta=beta, epsilon=epsilon, name=name, before_op=last
        )
    else:
        normed = mb.layer_norm(
            x=plan.x, axes=plan.axes, epsilon=epsilon, name=f"{name}_layernorm", before_op=last
        )
        out = mb.reshape(x=normed, shape=list(pattern.root_var.shape), name=name, before_op=last)
    pattern.replace_output(out)


def constraints_before_layer_norm(pattern: Pattern) -> bool | tuple[bool, str]:
    """``generic::fuse_group_norm``'s constraints: :func:`group_norm_constraints`, and a norm without
    reshapes only as an ``instance_norm`` that absorbs its affine (one op; the rest is the layer-norm
    pass's first)."""
    result = group_norm_constraints(pattern)
    if result is True and "reshape_in" not in pattern.ops and pattern.group_norm_plan.kind != "instance_norm":
        return False, (
            "a layer_norm without reshapes is left to common::fuse_layernorm_or_instancenorm, which runs "
            "later (then generic::fuse_group_norm_unreshaped)"
        )
    return result


def _register() -> None:
    """The reshaped spellings and the instance norms that absorb their affine before the layer-norm pass,
    the other spellings without reshapes after it (see the docstring)."""
    for pass_name, programs, constraints, leader in (
        (
            "fuse_group_norm",
            [(True, True), (True, False), (False, True)],
            constraints_before_layer_norm,
            "common::fuse_onehot_matmul_to_gather",
        ),
        (
            "fuse_group_norm_unreshaped",
            [(False, True), (False, False)],
            group_norm_constraints,
            "common::fuse_layernorm_or_instancenorm",
        ),
    ):
        register_generic_pass(
            ops_arrangement=[group_norm_pattern(grouped, affine) for grouped, affine in programs],
            var_constraints=constraints,
            transform_pattern=transform_group_norm,
            pass_name=pass_name,
            namespace="generic",
            constants="const",
            const_rules={"square.y": ConstRule("value", rtol=0.0, atol=0.0)},
            name="group_norm" if pass_name == "fuse_group_norm" else "group_norm_unreshaped",
            run_after=leader,
        )


_register()
