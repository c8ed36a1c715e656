"""``generic::remove_channels_last_round_trip``: norms and pointwise MLPs between a channels-last
transpose and its inverse, rewritten channels-first so that both transposes go.

ConvNeXt (torchvision, timm, the original code) permutes every block to channels-last for its layer norm
and MLP and back (``x.permute(0, 2, 3, 1)`` ... ``x.permute(0, 3, 1, 2)``), and its ``LayerNorm2d``
does the same around a lone layer norm: 44 ``transpose`` ops in torchvision's convnext_tiny, 34 in
timm's convnext_atto, which coremltools' ``reduce_transposes`` leaves (it cannot move a transpose
through ``layer_norm`` or ``linear``). Core ML's Neural Engine prefers channels-first tensors and
``linear`` as a 1x1 ``conv``.

Math. Let ``x`` be ``[B, C, *S]`` (``S`` one to three spatial axes), ``T = transpose(perm=[0, 2, ...,
r-1, 1])`` move the channels last and ``T^-1 = transpose(perm=[0, r-1, 1, ..., r-2])`` move them back.
Every op inside acts on the channel vector of each position on its own, so it commutes with moving the
channel axis, given the channel-first op of the same arithmetic::

    layer_norm(T(x), axes=[-1], g, b)   =  T(layer_norm(x, axes=[1], g, b))     (same mean, variance,
                                                                                 g and b per channel)
    linear(T(x), W, b)                  =  T(conv(x, W', b))                    (W' = W as [Cout, Cin, 1,
                                                                                 ..., 1]: a 1x1 conv maps
                                                                                 each position's channels)
    f(T(x))                             =  T(f(x))                              (f elementwise, scalar
                                                                                 parameters)
    T(x) * s,  T(x) + s                 =  T(x * s', x + s')                    (s: C values along the
                                                                                 last axis; s' = s as
                                                                                 [C, 1, ..., 1])

so ``T^-1(ops(T(x))) = ops'(x)``. Two patterns, the choices inside the second::

    Pattern 1 (LayerNorm2d):

        x --> transpose(0,2,3,1) --> layer_norm(axes=[-1]) --> transpose(0,3,1,2) --> y

    becomes:

        x --> layer_norm(axes=[1]) --> y

    Pattern 2 (pointwise MLP, optional norm before it and per-channel scale or shift after it):

        x --> transpose(0,2,3,1) --> [layer_norm(axes=[-1])] --> linear --> [f --> linear]
          --> [mul | add (s)] --> transpose(0,3,1,2) --> y

    becomes:

        x --> [layer_norm(axes=[1])] --> conv(1x1) --> [f --> conv(1x1)] --> [mul | add (s')] --> y

(``[...]``: present or not, 8 spellings; ``f`` any elementwise op of
``fuse_reshape_linear_reshape.UNARY_ELEMENTWISE`` with scalar or string parameters: ``gelu``, ``relu``,
``silu``, ...; shown for rank 4, the same for ranks 3 and 5.) The ``mul`` after the transpose back, a
layer scale, is then a convolution's, which ``common::fuse_conv_scale`` folds.

A ``layer_norm`` is matched with its ``gamma`` and ``beta`` (as PyTorch's ``LayerNorm`` converts).
Refused, with the reason: a ``perm`` other than the channels-last one and its inverse; a rank outside 3-5
(``conv`` has one to three spatial axes); a norm over other axes; a ``linear`` whose weight is compressed
(``constexpr_*`` ops: the 1x1 kernel would need the data reshaped) or not a constant; an op with a
tensor parameter; a scale that is not a scalar or one value per channel.

Each new op goes before the op it replaces and keeps its name; the last one takes the name of the
transpose back's output. The pass runs right after ``common::fuse_leaky_relu`` while
``ENABLE_EXPERIMENTAL_PASSES=1``: the GELU fusions have made the activations, and
``common::reduce_transposes`` (which moves transposes past adds and muls and splits the chain) has not
yet run.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation, Var

from pattern_infra import Pattern, optional, predicates, register_generic_pass

from .fuse_reshape_linear_reshape import UNARY_ELEMENTWISE

__all__ = [
    "norm_round_trip",
    "mlp_round_trip",
    "round_trip_constraints",
    "transform_round_trip",
]

_C, _HIDDEN = 4, 8
_TO_LAST, _TO_FIRST = [0, 2, 3, 1], [0, 3, 1, 2]
_RANKS = (3, 4, 5)
"""Ranks of ``x`` whose positions a ``conv`` can map (one to three spatial axes)."""


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def _norm(x: Var) -> Var:
    return mb.layer_norm(x=x, axes=[-1], gamma=_zeros(_C), beta=_zeros(_C), epsilon=1e-6, name="norm")


@mb.program(input_specs=[mb.TensorSpec(shape=(1, _C, 2, 2))])
def norm_round_trip(x):
    to_last = mb.transpose(x=x, perm=_TO_LAST, name="to_last")
    return mb.transpose(x=_norm(to_last), perm=_TO_FIRST, name="to_first")


@mb.program(input_specs=[mb.TensorSpec(shape=(1, _C, 2, 2))])
def mlp_round_trip(x):
    def normed() -> Var:
        return optional("normed", lambda: mb.transpose(x=x, perm=_TO_LAST, name="to_last"), _norm)

    def fc1() -> Var:
        return mb.linear(x=normed(), weight=_zeros(_HIDDEN, _C), bias=_zeros(_HIDDEN), name="fc1")

    def mlp() -> Var:
        def second(h: Var) -> Var:
            act = mb.gelu(x=h, name="act")  # any op of UNARY_ELEMENTWISE (alternatives)
            return mb.linear(x=act, weight=_zeros(_C, _HIDDEN), bias=_zeros(_C), name="fc2")

        return optional("mlp", fc1, second)

    scaled = optional("scaled", mlp, lambda h: mb.mul(x=h, y=_zeros(_C), name="scale"))
    return mb.transpose(x=scaled, perm=_TO_FIRST, name="to_first")


def _channel_ops(pattern: Pattern) -> list[Operation]:
    """The matched ops between the transposes, in data-flow order."""
    ops = pattern.ops
    return [ops[name] for name in ("norm", "fc1", "act", "fc2", "scale") if name in ops]


def _perm(op: Operation) -> list[int] | None:
    perm = predicates.value_of(op.perm)
    return None if perm is None else [int(p) for p in np.reshape(perm, -1)]


def _refusal(op: Operation, rank: int) -> str | None:
    """Why ``op`` (between the transposes, its input of rank ``rank``) has no channels-first twin."""
    kind = op.op_type
    if kind == "layer_norm":
        axes = predicates.value_of(op.axes)
        if axes is None or [int(a) % rank for a in np.reshape(axes, -1)] != [rank - 1]:
            return f"{op.name} normalises over axes {axes}, not the channels (the last axis) alone"
        return None
    if kind == "linear":
        if op.weight.val is None:
            return (
                f"the weight {op.weight.name} of {op.name} is compressed or not a constant: a 1x1 conv "
                "would need it reshaped"
            )
        return None
    if kind in ("mul", "add"):
        scale = _scale_operand(op)
        if scale is None:
            return f"{op.name} has no constant operand"
        value = np.asarray(scale.val)
        channels = op.outputs[0].shape[-1]
        if value.size != 1 and (value.size != channels or value.shape[-1] != channels or value.ndim > rank):
            return f"{op.name}'s constant of shape {value.shape} is not one value per channel"
        return None
    for slot, var in op.inputs.items():  # an elementwise op: scalar or string parameters only
        if slot == "x":
            continue
        if not predicates.is_constant(var) or predicates.is_constexpr(var):
            return f"{op.name}'s {slot} is not a constant"
        if not isinstance(var.val, str) and np.asarray(var.val).size != 1:
            return f"{op.name}'s {slot} is not a scalar"
    return None


def _scale_operand(op: Operation) -> Var | None:
    """The constant operand of a ``mul`` / ``add`` (the other one is the chain)."""
    for var in (op.x, op.y):
        if var.val is not None:
            return var
    return None


def round_trip_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """The transposes move the channels last and back; every op between has a channels-first twin.

    Returns:
        True, or ``(False, reason)``.
    """
    x = pattern.root_var
    rank = x.rank
    if rank not in _RANKS:
        return False, f"x of rank {rank}, not 3 to 5 (a conv's one to three spatial axes)"
    to_last = [0, *range(2, rank), 1]
    to_first = [0, rank - 1, *range(1, rank - 1)]
    if _perm(pattern.to_last) != to_last:
        return False, f"the first transpose's perm {_perm(pattern.to_last)} is not {to_last}"
    if _perm(pattern.to_first) != to_first:
        return False, f"the last transpose's perm {_perm(pattern.to_first)} is not {to_first}"
    for op in _channel_ops(pattern):
        reason = _refusal(op, rank)
        if reason is not None:
            return False, reason
    return True


def _channels_first(op: Operation, x: Var, name: str) -> Var:
    """The channels-first twin of ``op`` reading ``x``, before ``op``."""
    kind, rank = op.op_type, x.rank
    if kind == "layer_norm":
        norm = {slot: op.inputs[slot] for slot in ("gamma", "beta", "epsilon") if slot in op.inputs}
        return mb.layer_norm(x=x, axes=[1], **norm, name=name, before_op=op)
    if kind == "linear":
        weight = op.weight.val
        kernel = np.reshape(weight, weight.shape + (1,) * (rank - 2))
        return mb.conv(x=x, weight=kernel, bias=op.bias, pad_type="valid", name=name, before_op=op)
    if kind in ("mul", "add"):
        scale = _scale_operand(op)
        assert scale is not None, "round_trip_constraints refuses a mul/add without a constant"
        value = np.asarray(scale.val)
        if value.size != 1:
            shape = (value.size,) + (1,) * (rank - 2)
            scale = mb.const(val=np.reshape(value, (1,) * (value.ndim - len(shape)) + shape), before_op=op)
        return getattr(mb, kind)(x=x, y=scale, name=name, before_op=op)
    params = {slot: var for slot, var in op.inputs.items() if slot != "x"}
    return getattr(mb, kind)(x=x, **params, name=name, before_op=op)


def transform_round_trip(pattern: Pattern) -> None:
    """The ops between the transposes, channels-first, on ``x``; the framework removes the old ones."""
    ops = _channel_ops(pattern)
    h = pattern.root_var
    for op in ops:
        name = pattern.to_first.outputs[0].name if op is ops[-1] else op.outputs[0].name
        h = _channels_first(op, h, name)
    pattern.replace_output(h)


register_generic_pass(
    ops_arrangement=norm_round_trip,
    var_constraints=round_trip_constraints,
    transform_pattern=transform_round_trip,
    pass_name="remove_channels_last_round_trip",
    namespace="generic",
    name="norm_round_trip",
    run_after="common::fuse_leaky_relu",
)
register_generic_pass(
    ops_arrangement=mlp_round_trip,
    var_constraints=round_trip_constraints,
    transform_pattern=transform_round_trip,
    pass_name="remove_channels_last_round_trip",
    namespace="generic",
    alternatives={"act": UNARY_ELEMENTWISE, "scale": ["mul", "add"]},
    const_rules={"fc1.weight": "weight", "fc2.weight": "weight", "scale.y": "const"},
    name="mlp_round_trip",
    run_after="common::fuse_leaky_relu",
)
