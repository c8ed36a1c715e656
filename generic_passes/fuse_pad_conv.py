"""``common::fuse_pad_conv``: move a ``pad`` below the ``transpose`` that separates it from a convolution.

Math: padding works axis by axis, so padding then permuting the axes is permuting then padding with the
per-axis amounts permuted the same way: ``transpose(pad(x, P), perm) = pad(transpose(x, perm), P')``
with ``P'[i] = P[perm[i]]`` (``P`` given for the last axes only, missing leading axes being 0; ``P'`` must
leave the leading axes unpadded as well). Once the ``pad`` is next to the convolution, later stages can
merge it into the convolution's own padding. This holds for every pad mode.

One pattern; it returns both ops, so the ``pad`` may feed several ``transpose`` ops and each is rewritten
by its own match (the ``pad`` is removed with the last)::

    x --> pad(P) --> transpose(perm) --> conv ...      (the transpose may have other users too)

    becomes:

    x --> transpose(perm) --> pad(P') --> conv ...

As coremltools does, the new ``transpose`` and ``pad`` are inserted (unnamed) before the old
``transpose``, the ``pad`` keeping the old one's mode and constant; every user of the old ``transpose``
reads the new ``pad``.

Refusals kept from coremltools: every user of the ``pad`` must be such a ``transpose`` (one with a
convolution user, of any op type containing ``conv``), otherwise the ``pad`` would have to stay and be
duplicated; the ``pad`` output must not be a block output. Where coremltools 9.0 raises, this pass
refuses: a non-constant ``P`` (coremltools removes ops that still have users); a ``perm`` that moves a
padded axis into the unpadded leading axes (coremltools passes ``pad=False``). coremltools visits the
``transpose`` ops in set order, so with several of them its automatic op names vary from run to run;
here they follow program order.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Operation

from pattern_infra import Pattern, register_generic_pass

__all__ = ["pad_transpose_pattern", "pad_conv_constraints", "transform_pad_conv", "permuted_pad"]


@mb.program(input_specs=[mb.TensorSpec(shape=(1, 4, 4, 2))])
def pad_transpose_pattern(x):
    pad = mb.pad(x=x, pad=np.array([1, 1, 1, 1, 0, 0], dtype=np.int32), name="pad")
    transpose = mb.transpose(x=pad, perm=[0, 3, 1, 2], name="transpose")
    return pad, transpose


def permuted_pad(pad: Operation, transpose: Operation) -> np.ndarray | None:
    """The pad amounts for ``transpose(x)`` equivalent to ``pad``'s for ``x``; None if there are none."""
    amounts, perm = pad.pad.val, transpose.perm.val
    if amounts is None or perm is None:
        return None
    amounts = np.reshape(amounts, (-1, 2))
    perm = np.asarray(perm).reshape(-1)
    rank_diff = len(perm) - amounts.shape[0]
    if rank_diff < 0:
        return None
    full = np.concatenate((np.zeros((rank_diff, 2), dtype=amounts.dtype), amounts))
    permuted = full[perm]
    if np.any(permuted[:rank_diff] != 0):
        return None  # a padded axis would move into the leading axes the pad does not cover
    return permuted[rank_diff:].flatten().astype(amounts.dtype)


def _feeds_conv(op: Operation) -> bool:
    return op.op_type == "transpose" and any("conv" in user.op_type for user in op.outputs[0].child_ops)


def pad_conv_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Every user of the ``pad`` is a ``transpose`` feeding a convolution, each with a permuted pad.

    Returns:
        True, or ``(False, reason)``.
    """
    pad = pattern.pad
    out = pad.outputs[0]
    if out in pad.enclosing_block.outputs or out.consuming_blocks:
        return False, "the pad's output is a block output"
    if not _feeds_conv(pattern.transpose):
        return False, "the transpose feeds no convolution"
    for user in dict.fromkeys(out.child_ops):
        if not _feeds_conv(user) or permuted_pad(pad, user) is None:
            return (
                False,
                f"the pad's user {user.name} is not a transpose feeding a convolution with a permuted pad",
            )
    return True


def transform_pad_conv(pattern: Pattern) -> None:
    """Inserts ``transpose`` then ``pad`` before the old ``transpose`` and redirects its users."""
    pad, transpose = pattern.pad, pattern.transpose
    new_transpose = mb.transpose(x=pad.x, perm=transpose.perm.val, before_op=transpose)
    kwargs = {k: v for k, v in pad.inputs.items() if k not in ("x", "pad")}
    new_pad = mb.pad(x=new_transpose, pad=permuted_pad(pad, transpose), **kwargs, before_op=transpose)
    pattern.replace_output(new_pad, old_var=transpose.outputs[0])


register_generic_pass(
    ops_arrangement=pad_transpose_pattern,
    var_constraints=pad_conv_constraints,
    transform_pattern=transform_pad_conv,
    pass_name="fuse_pad_conv",
    namespace="common",
    const_rules={"pad.pad": "const", "transpose.perm": "const"},
    name="pad_conv",
)
