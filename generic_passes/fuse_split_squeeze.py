"""``generic::fuse_split_squeeze``: a ``split`` into single indices, each ``squeeze``d, as one slice each.

PyTorch's ``qkv.unbind(0)`` (timm's attention: ``q, k, v = qkv.unbind(0)``) converts to a ``split`` of
the axis into pieces of 1 and a ``squeeze`` of that axis on every piece: ``n + 1`` ops for ``n``
tensors. ``slice_by_index`` takes one index and drops the axis in one op (``squeeze_mask``), the form
torchvision's ``qkv[i]`` converts to.

Math: piece ``i`` of ``split(x, [1] * n, axis=a)`` is ``x[..., i:i+1, ...]``; squeezing ``a`` gives
``x[..., i, ...]``, which is ``slice_by_index`` with ``begin[a] = i``, ``end[a] = i + 1`` and
``squeeze_mask[a]`` set, every other axis taken whole::

    x[3, 1, 3, 17, 64] --> split(split_sizes=[1, 1, 1], axis=0) --> [1, 1, 3, 17, 64] --> squeeze([0]) --> q
                                                                --> [1, 1, 3, 17, 64] --> squeeze([0]) --> k
                                                                --> [1, 1, 3, 17, 64] --> squeeze([0]) --> v

    becomes:

        x[3, 1, 3, 17, 64] --> slice_by_index(x[0]) --> q
                           --> slice_by_index(x[1]) --> k
                           --> slice_by_index(x[2]) --> v

Two patterns, a split in three (q, k, v) and in two (k, v). Each slice takes the name of the ``squeeze``
output it replaces. Refused: a piece of size other than 1, a ``squeeze`` of other axes as well (or of
none named), a split axis of symbolic size. The match guarantees that every piece feeds only its
``squeeze`` (the pieces are not block outputs).

Runs with the override on right after ``generic::fuse_sdpa``.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb

from pattern_infra import Pattern, register_generic_pass

__all__ = ["split_squeeze_2", "split_squeeze_3"]


def _split_squeeze(n: int):
    @mb.program(input_specs=[mb.TensorSpec(shape=(n, 4, 5))])
    def split_squeeze(x):
        pieces = mb.split(x=x, split_sizes=[1] * n, axis=0, name="split")
        return tuple(mb.squeeze(x=p, axes=[0], name=f"squeeze_{i}") for i, p in enumerate(pieces))

    return split_squeeze


split_squeeze_3 = _split_squeeze(3)
split_squeeze_2 = _split_squeeze(2)


def _axis(pattern: Pattern) -> int:
    x = pattern.root_var
    return int(pattern.split.axis.val) % x.rank


def constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Pieces of 1 along a static axis, each squeezed on that axis only."""
    x, split = pattern.root_var, pattern.split
    if x.shape is None or split.axis.val is None:
        return False, "the input's shape or the split axis is unknown"
    axis = _axis(pattern)
    if any(out.shape is None or out.shape[axis] != 1 for out in split.outputs):
        return False, f"a piece is not of size 1 on axis {axis}"
    for op in pattern.final_ops:
        axes = op.axes
        if axes is None or axes.val is None:
            return False, f"{op.name} names no axes"
        if sorted(int(a) % x.rank for a in axes.val.reshape(-1)) != [axis]:
            return False, f"{op.name} squeezes axes {axes.val.tolist()}, not only the split axis {axis}"
    return True


def transform(pattern: Pattern) -> None:
    """One ``slice_by_index`` per piece, named like its ``squeeze``'s output, before the ``split``."""
    x, axis = pattern.root_var, _axis(pattern)
    rank = x.rank
    replacements = []
    for op in pattern.final_ops:
        i = list(pattern.split.outputs).index(op.x)
        begin, end = [0] * rank, [0] * rank
        begin[axis], end[axis] = i, i + 1
        replacements.append(
            mb.slice_by_index(
                x=x,
                begin=begin,
                end=end,
                end_mask=[j != axis for j in range(rank)],
                squeeze_mask=[j == axis for j in range(rank)],
                name=op.outputs[0].name,
                before_op=pattern.split,
            )
        )
    pattern.replace_outputs(replacements)


for _pattern in (split_squeeze_3, split_squeeze_2):
    register_generic_pass(
        ops_arrangement=_pattern,
        var_constraints=constraints,
        transform_pattern=transform,
        pass_name="fuse_split_squeeze",
        namespace="generic",
        name=f"split_squeeze_{len(_pattern.functions['main'].find_ops(op_type='squeeze'))}",
        run_after="generic::fuse_sdpa",
    )
