"""What a layer-norm or instance-norm match computes, and which op it becomes (the semantic half of
``common::fuse_layernorm_or_instancenorm``; the patterns and their registration are in
:mod:`generic_passes.fuse_layernorm_or_instancenorm`).

Which op, decided as coremltools decides (so the program is the one coremltools produces wherever it
fuses): ``layer_norm`` when the axes are the trailing ones and gamma/beta have one dimension per axis, or
for rank 4 and axes [-3] (channels-first, gamma/beta of shape [C]); ``instance_norm`` for rank 4, axes
[-2, -1] or [-3, -2], and gamma/beta that squeeze to [C]. The inserted ops sit before the last matched op;
the norm takes the name of the output it replaces (``<name>_layernorm`` / ``<name>_instancenorm``
between ``<name>_transpose_nhwc_nchw`` and ``<name>_transpose_nchw_nhwc`` for NHWC).

Beyond coremltools, and correct by the math: gamma/beta of any shape that acts along the normalised axes
only (``[C,1,1]`` for ConvNeXt channels-first, ``[1,1,D]``, a scalar), reshaped or broadcast to the
normalised shape. Refusals coremltools lacks, because its fusion would be wrong or would crash: the two
reductions differ in axes; gamma/beta act along an axis that is not normalised (e.g. a ``[C]`` gamma on an
NCHW axes-[1] norm, a ``[1,1,1,W]`` gamma on an instance norm); the ``1/N`` of pattern 4 is not ``1/N``;
broadcasting makes the output shape differ from ``x``'s. Like coremltools, ``rsqrt``'s own ``epsilon``
(``1e-12`` by default) is not added to ``eps``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var, types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra import Pattern, predicates

__all__ = [
    "constraints_1",
    "constraints_3",
    "constraints_4",
    "constraints_5_affine",
    "constraints_written_out",
    "transform_norm",
]

logger = logging.getLogger("generic_passes.fuse_layernorm_or_instancenorm")


# -- what a match says, and which op it becomes --------------------------------------------------------------


@dataclass(slots=True)
class _Affine:
    """A gamma or a beta: what coremltools hands to the fused op, and what it really does to ``x``."""

    array: np.ndarray
    """The value coremltools works with (``gamma_var.val``; squeezed for pattern 5)."""
    var: Var | None
    """The program variable holding ``array``, when there is one (else a const is made from ``array``)."""
    effect: np.ndarray
    """The tensor the written-out program multiplies or adds, right-aligned against ``x``."""
    const_name: str | None = None
    """Name coremltools gives the const it makes for ``array`` (pattern 5)."""
    trivial: bool = False
    """Pattern 3's invented ones / zeros: numerically the identity."""

    @staticmethod
    def of(var: Var) -> _Affine:
        value = np.asarray(_value(var))
        return _Affine(array=value, var=var, effect=value)


@dataclass(slots=True)
class _Norm:
    """What a match computes: a normalisation of ``x`` over ``axes``."""

    x: Var
    shape: tuple | None
    """``x.shape``, read once (every read of ``Var.shape`` re-derives it from the type)."""
    axes: list[int]
    """The axes exactly as the first reduction holds them."""
    eps: Var
    gamma: _Affine | None
    beta: _Affine | None
    end_op: Operation
    """The last matched op: the fused op goes before it and takes its output's name."""


@dataclass(slots=True)
class _Plan:
    """The replacement to build."""

    kind: Literal["layer_norm", "instance_norm"]
    transpose: bool
    gamma: Var | np.ndarray | _Affine | None
    beta: Var | np.ndarray | _Affine | None


def _float_dtype(var: Var) -> bool:
    return var.dtype in (types.fp16, types.fp32)


def _keeps_shape(out: tuple, x: tuple) -> bool:
    """``out`` is ``x``'s shape; a static size > 1 where ``x`` has a symbol only pins the symbol."""
    return len(out) == len(x) and all(
        bool(o == d) or (is_symbolic(d) and not is_symbolic(o) and int(o) != 1) for o, d in zip(out, x)
    )


def _dims_fit(have: tuple, want: tuple) -> bool:
    """``have`` (a constant's static shape) equals ``want`` (dims of ``x``; a symbol accepts any size)."""
    return len(have) == len(want) and all(is_symbolic(w) or int(h) == int(w) for h, w in zip(have, want))


def _aligned(effect_shape: tuple, x_shape: tuple, axes: set[int], *, broadcast: bool) -> tuple | None:
    """The shape ``effect`` acts with along ``axes`` of ``x``, or None if it acts along any other axis.

    With ``broadcast`` a size-1 dimension on a normalised axis of static size is accepted (the value is
    then repeated along it); otherwise every normalised dimension must match ``x``'s.
    """
    rank = len(x_shape)
    if len(effect_shape) > rank:
        return None
    padded = (1,) * (rank - len(effect_shape)) + tuple(int(d) for d in effect_shape)
    out = []
    for i, (e, d) in enumerate(zip(padded, x_shape)):
        if i not in axes:
            if e != 1:
                return None
            continue
        if is_symbolic(d):
            if e == 1:
                return None  # would repeat over a size unknown at compile time
            out.append(e)
        elif e == int(d):
            out.append(e)
        elif broadcast and e == 1:
            out.append(int(d))
        else:
            return None
    return tuple(out)


def _to_normalized(effect: np.ndarray, x_shape: tuple, axes: set[int], dtype: type) -> np.ndarray | None:
    shape = _aligned(effect.shape, x_shape, axes, broadcast=True)
    if shape is None:
        return None
    rank = len(x_shape)
    padded = effect.reshape((1,) * (rank - effect.ndim) + effect.shape)
    full = [shape[sorted(axes).index(i)] if i in axes else 1 for i in range(rank)]
    return np.array(np.broadcast_to(padded, full).reshape(shape), dtype=dtype)


def _coremltools_plan(norm: _Norm) -> _Plan | None:
    """coremltools' decision between layer_norm and instance_norm, with its wrong fusions refused."""
    x_shape, gamma, beta = norm.shape, norm.gamma, norm.beta
    assert x_shape is not None, "_check plans only an x of known shape"
    rank = len(x_shape)
    neg = sorted(a - rank if a >= 0 else a for a in norm.axes)
    g_rank = gamma.array.ndim if gamma is not None else -1
    b_rank = beta.array.ndim if beta is not None else -1
    pos = {a + rank for a in neg}
    x_norm = tuple(x_shape[i] for i in sorted(pos))

    def along(p: _Affine | None, axes: set[int]) -> bool:
        return p is None or p.trivial or _aligned(p.effect.shape, x_shape, axes, broadcast=False) is not None

    if rank == 4 and neg == [-3]:
        if not ((gamma is None and beta is None) or (g_rank == 1 and b_rank == 1)):
            return None
        for p in (gamma, beta):
            if p is not None and (not _dims_fit(p.array.shape, x_norm) or not along(p, pos)):
                return None
        return _Plan("layer_norm", False, gamma.array if gamma else None, beta.array if beta else None)

    if rank == 4 and neg in ([-2, -1], [-3, -2]) and gamma is not None and beta is not None:
        g_sq, b_sq = np.squeeze(gamma.array), np.squeeze(beta.array)
        if g_sq.ndim == 1 and b_sq.ndim == 1:
            transpose = neg == [-3, -2]
            channel = 3 if transpose else 1
            c = x_shape[channel]
            params = []
            for p, squeezed, fill in ((gamma, g_sq, np.ones), (beta, b_sq, np.zeros)):
                if p.trivial and not is_symbolic(c) and squeezed.shape != (int(c),):
                    squeezed = fill(int(c), dtype=squeezed.dtype)  # coremltools sizes them by H for NHWC
                if not _dims_fit(squeezed.shape, (c,)) or not along(p, {channel}):
                    return None
                params.append(squeezed)
            return _Plan("instance_norm", transpose, params[0], params[1])

    trailing = neg == list(range(-len(neg), 0))
    if trailing and gamma is not None and beta is not None and g_rank == b_rank == len(norm.axes):
        for p in (gamma, beta):
            if not _dims_fit(p.array.shape, x_norm) or not along(p, pos):
                return None
        return _Plan("layer_norm", False, gamma, beta)
    return None


def _general_plan(norm: _Norm) -> _Plan | None:
    """Our layer_norm where coremltools' decision refuses: gamma/beta of any shape acting along the axes."""
    x_shape = norm.shape
    assert x_shape is not None, "_check plans only an x of known shape"
    rank = len(x_shape)
    neg = sorted(a - rank if a >= 0 else a for a in norm.axes)
    if not (neg == list(range(-len(neg), 0)) or (rank == 4 and neg == [-3])):
        return None
    pos = {a + rank for a in neg}
    dtype = types.nptype_from_builtin(norm.x.dtype)
    out: list[Var | np.ndarray | None] = []
    for p in (norm.gamma, norm.beta):
        if p is None or p.trivial:
            out.append(None)
            continue
        value = _to_normalized(p.effect, x_shape, pos, dtype)
        if value is None:
            return None
        if p.var is not None and p.effect is p.array and p.array.shape == value.shape:
            out.append(p.var)  # already the normalised shape: keep the program's const
        else:
            out.append(value)
    gamma, beta = out
    if gamma is None and beta is not None:
        # layer_norm's type inference reads gamma.shape to check beta: give it the identity gamma.
        gamma = np.ones(np.shape(beta.val if isinstance(beta, Var) else beta), dtype=dtype)
    return _Plan("layer_norm", False, gamma, beta)


def _check(norm: _Norm, reductions: list[Operation]) -> _Plan | None:
    """Semantic checks shared by every pattern, then the plan (None: leave the match alone)."""
    x_shape = norm.shape
    if x_shape is None or len(x_shape) == 0 or not _float_dtype(norm.x):
        return None
    rank = len(x_shape)
    axes_sets = []
    for red in reductions:
        axes_value = _value(red.axes) if red.axes is not None else None
        if axes_value is None or red.keep_dims is None or not _value(red.keep_dims):
            return None
        axes = _int_axes(axes_value)
        normalized = {a + rank if a < 0 else a for a in axes}
        if len(normalized) != len(axes) or not all(0 <= a < rank for a in normalized):
            return None
        axes_sets.append(normalized)
    if any(s != axes_sets[0] for s in axes_sets):
        return None  # coremltools does not compare the two reductions' axes
    eps = _value(norm.eps)
    if eps is None or np.shape(eps) != ():
        return None
    out_shape = norm.end_op.outputs[0].shape
    if out_shape is None or not _keeps_shape(tuple(out_shape), x_shape):
        return None  # a constant broadcast x to another shape
    return _coremltools_plan(norm) or _general_plan(norm)


def _value(var: Var) -> Any:
    """``var.val``, read straight from the variable when it holds a number or a numeric array:
    ``Var.val`` searches the value for symbols on every read, and those have none (the constraints read
    8 per match)."""
    held = var._sym_val
    if held is None:
        return None
    value = held.val
    if type(value) in _PLAIN or (isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biuf"):
        return value
    return var.val


_PLAIN = (bool, int, float)


def _int_axes(value: Any) -> list[int]:
    """A reduction's constant ``axes`` value (a scalar or an array) as a list of ints."""
    return [int(a) for a in np.atleast_1d(value)]


def _axes_of(op: Operation) -> list[int]:
    return _int_axes(_value(op.axes))


_REFUSED = "shapes, axes, keep_dims or constants do not make a layer or instance norm"
"""The reason :func:`_accept` gives (:func:`_check` tells no more, to stay fast)."""


def _accept(
    pattern: Pattern, reductions: tuple[Operation, Operation], gamma: _Affine | None, beta: _Affine | None
) -> bool | tuple[bool, str]:
    """Plans the normalisation every pattern computes and keeps the plan on ``pattern`` for
    :func:`transform_norm`: of ``x`` over the axes of the first of its two ``reductions`` (none if they
    are not constant), with the ``eps`` of ``add_eps``, ending at the last matched op."""
    first_axes = _value(reductions[0].axes)
    x = pattern.root_var
    x_shape = x.shape
    norm = _Norm(
        x=x,
        shape=tuple(x_shape) if x_shape is not None else None,
        axes=_int_axes(first_axes) if first_axes is not None else [],
        eps=pattern.operand("add_eps", "y"),
        gamma=gamma,
        beta=beta,
        end_op=pattern.final_op,
    )
    plan = _check(norm, list(reductions))
    if plan is None:
        logger.debug("%s: %s left alone (shapes, axes or constants)", pattern.pattern_name, norm.end_op.name)
        return False, _REFUSED
    pattern.add_attribute("norm", norm)
    pattern.add_attribute("plan", plan)
    return True


def _const_or_value(
    value: Var | np.ndarray | _Affine | None, before_op: Operation
) -> Var | np.ndarray | None:
    if isinstance(value, _Affine):
        if value.var is not None:
            return value.var
        return mb.const(val=value.array, name=value.const_name, before_op=before_op)
    return value


def transform_norm(pattern: Pattern) -> None:
    """Builds the layer_norm / instance_norm the constraints planned and redirects the output."""
    norm: _Norm = pattern.norm
    plan: _Plan = pattern.plan
    end_op = norm.end_op
    out_name = end_op.outputs[0].name
    x = norm.x
    if plan.transpose:
        x = mb.transpose(x=x, perm=[0, 3, 1, 2], name=out_name + "_transpose_nhwc_nchw", before_op=end_op)
    gamma = _const_or_value(plan.gamma, end_op)
    beta = _const_or_value(plan.beta, end_op)
    if plan.kind == "instance_norm":
        build, axes_arg, suffix = mb.instance_norm, {}, "_instancenorm"
    else:
        build, axes_arg, suffix = mb.layer_norm, {"axes": norm.axes}, "_layernorm"
    y = build(
        x=x,
        **axes_arg,
        gamma=gamma,
        beta=beta,
        epsilon=norm.eps,
        name=out_name + suffix if plan.transpose else out_name,
        before_op=end_op,
    )
    if plan.transpose:
        y = mb.transpose(x=y, perm=[0, 2, 3, 1], name=out_name + "_transpose_nchw_nhwc", before_op=end_op)
    pattern.replace_output(y)


# -- reading each pattern's match ----------------------------------------------------------------------------


def _folded_gamma_beta(pattern: Pattern) -> tuple[_Affine, _Affine]:
    """Gamma and beta of the folded form ``x * k + (beta - mean * k)``, ``k = rsqrt(v) * gamma``
    (patterns 1 and 4)."""
    return _Affine.of(pattern.operand("mul_gamma", "y")), _Affine.of(pattern.operand("sub_beta", "x"))


def constraints_1(pattern: Pattern) -> bool | tuple[bool, str]:
    return _accept(pattern, (pattern.mean, pattern.mean_sq), *_folded_gamma_beta(pattern))


def constraints_3(pattern: Pattern) -> bool | tuple[bool, str]:
    x = pattern.root_var
    if x.shape is None or x.rank < 2 or is_symbolic(x.shape[1]) or not _float_dtype(x):
        return False, "x's axis 1 is not of known size, or x is not fp16/fp32"  # sizes coremltools' ones
    dtype = types.nptype_from_builtin(x.dtype)
    shape = (1, int(x.shape[1]), 1, 1)
    ones, zeros = np.ones(shape, dtype), np.zeros(shape, dtype)
    gamma = _Affine(ones, None, ones, "_fuse_layernorm_or_instancenorm_gamma", trivial=True)
    beta = _Affine(zeros, None, zeros, "_fuse_layernorm_or_instancenorm_beta", trivial=True)
    return _accept(pattern, (pattern.mean, pattern.mean_sq), gamma, beta)


def _scale_is_inverse_count(scale: Var, x: Var, reduce_op: Operation) -> bool:
    if scale.val is None or np.size(scale.val) != 1 or x.shape is None or reduce_op.axes.val is None:
        return False
    count = 1
    for a in np.atleast_1d(reduce_op.axes.val):
        dim = x.shape[int(a)]
        if is_symbolic(dim):
            return False
        count *= int(dim)
    # 1e-5 as coremltools, or the constant's own rounding (a float16 1/N of a saved model: 2**-11)
    atol = predicates.dtype_rtol(scale, 1e-5)
    return bool(np.isclose(float(np.asarray(scale.val).reshape(())) * count, 1.0, rtol=0.0, atol=atol))


def constraints_4(pattern: Pattern) -> bool | tuple[bool, str]:
    x = pattern.root_var
    if x.shape is None:
        return False, "x of unknown shape"
    for scale in ("mean_sq", "mean"):  # coremltools only asks for a scalar; it must be 1/N
        if not _scale_is_inverse_count(pattern.operand(scale, "y"), x, pattern.sum_x):
            return False, f"the scale of {scale} is not 1/N for the N elements summed"
    return _accept(pattern, (pattern.sum_x, pattern.sum_sq), *_folded_gamma_beta(pattern))


def constraints_5_affine(pattern: Pattern) -> bool | tuple[bool, str]:
    if pattern.mean.axes.val is None or _axes_of(pattern.mean) != [1] or _axes_of(pattern.mean_sq) != [1]:
        return False, "the means are not over axis 1"  # as coremltools; other axes: the written-out family
    g_var, b_var = pattern.operand("mul_gamma", "y"), pattern.operand("add_beta", "y")
    g_val, b_val = np.asarray(g_var.val), np.asarray(b_var.val)
    g_sq = np.squeeze(g_val)
    b_effect = b_val * g_val  # y = (n + b) * g = n * g + b * g
    try:
        b_sq = np.squeeze(b_val) * g_sq  # what coremltools computes (and crashes on if it cannot)
    except ValueError:
        b_sq = b_effect
    gamma = _Affine(array=g_sq, var=None, effect=g_val, const_name="_fuse_layernorm_gamma")
    beta = _Affine(array=b_sq, var=None, effect=b_effect, const_name="_fuse_layernorm_beta")
    return _accept(pattern, (pattern.mean, pattern.mean_sq), gamma, beta)


def constraints_written_out(pattern: Pattern) -> bool | tuple[bool, str]:
    ops = pattern.ops
    gamma = _Affine.of(pattern.operand("mul_gamma", "x")) if "mul_gamma" in ops else None
    beta = _Affine.of(pattern.operand("add_beta", "y")) if "add_beta" in ops else None
    return _accept(pattern, (pattern.mean, pattern.mean_sq), gamma, beta)
