"""MIL programs of one attention step over a KV cache, written as a flexible-shape conversion writes them.

:mod:`.stateful`'s decoder, exported with dynamic query and cache lengths, converts to attention whose
sizes are symbols computed at run time: the cache is sliced up to ``S = causal_mask.shape[-1]`` (a
``shape`` / ``gather`` / ``concat`` chain for ``end``), ``repeat_kv`` becomes a ``tile`` whose reps are
``real_div(select(equal(target, -1), shape(x), target), shape(x))`` (coremltools' broadcast of a
symbolic shape) and a ``reshape`` to ``[1, H, -1, E]``, and every such op gives its output fresh
symbols. :func:`cached_attention` builds that structure directly, small and without torch, for the pass
tests; its variants are the near misses a pass must leave alone.

The flexible inputs carry declared ranges (``RangeDim(1, MAX_LENGTH)`` in ``function.input_types``, as
a conversion with ``torch.export.Dim`` records them), which is what proves a slice of the cache
``[0, S)`` is not clamped.
"""

from __future__ import annotations

import math

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, Var, get_new_symbol, types

__all__ = ["CACHE", "HEADS", "KV_HEADS", "HEAD_DIM", "MAX_LENGTH", "cached_attention", "declare_ranges"]

CACHE = 16
"""Cache length of the programs."""
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
"""Query heads, key/value heads, head size."""
MAX_LENGTH = 15
"""Upper bound declared for the flexible lengths (below :data:`CACHE`)."""


def declare_ranges(prog: Program, bounds: dict[str, tuple[int, int]]) -> None:
    """Records ``RangeDim`` ranges for symbolic input dims, as a conversion with flexible inputs does.

    Args:
        prog: The program; its main function's ``input_types`` are set.
        bounds: Symbol name to ``(lower, upper)``; symbols not listed get no declared range.
    """
    func = prog.functions["main"]
    declared = []
    for name, var in func.inputs.items():
        shape = tuple(_range(d, bounds[str(d)]) if str(d) in bounds else d for d in var.shape)
        declared.append(ct.TensorType(name=name, shape=shape, dtype=types.nptype_from_builtin(var.dtype)))
    func.set_input_types(tuple(declared))


def _range(symbol: object, bounds: tuple[int, int]) -> ct.RangeDim:
    dim = ct.RangeDim(*bounds)
    dim.symbol = symbol  # the input's own symbol (RangeDim(symbol=name) refuses a name already in use)
    return dim


def cached_attention(
    *,
    bounded: bool = True,
    mask_length: str = "same",
    reps_length: str = "same",
    groups: int = HEADS // KV_HEADS,
) -> Program:
    """``softmax(q @ repeat_kv(k_cache[..., :S, :])^T / sqrt(E) + mask) @ repeat_kv(v_cache[..., :S, :])``.

    Inputs ``q [1, KV_HEADS * groups, L, E]``, ``k_cache``, ``v_cache [1, KV_HEADS, CACHE, E]``, ``mask [1, 1,
    L, S]`` (``L``, ``S`` symbols), and ``other [1, S2]`` whose length only the variants read.

    Args:
        bounded: Declare ``L``, ``S`` (and ``S2``) in ``[1, MAX_LENGTH]``; without, ``S <= CACHE`` is not
            provable.
        mask_length: ``"same"``: the cache is sliced to the mask's length; ``"other"``: to the length of
            ``other`` (a mask of a different length than the keys).
        reps_length: ``"same"``: the ``repeat_kv`` target names the sliced length, so the reps are
            ``[1, 1, G, 1, 1]``; ``"other"``: it names ``L`` instead (reps not provably ``G``).
        groups: Query heads per key/value head.
    """
    length, cache_len, other_len = get_new_symbol(), get_new_symbol(), get_new_symbol()
    heads = KV_HEADS * groups
    specs = [
        mb.TensorSpec(shape=(1, heads, length, HEAD_DIM)),
        mb.TensorSpec(shape=(1, KV_HEADS, CACHE, HEAD_DIM)),
        mb.TensorSpec(shape=(1, KV_HEADS, CACHE, HEAD_DIM)),
        mb.TensorSpec(shape=(1, 1, length, cache_len)),
        mb.TensorSpec(shape=(1, other_len)),
    ]

    def repeat(cache: Var, end: Var, target_len: Var, name: str) -> Var:
        sliced = mb.slice_by_index(
            x=cache,
            begin=[0, 0, 0, 0],
            end=mb.concat(values=[1, KV_HEADS, end, HEAD_DIM], axis=0),
            end_mask=[True, True, False, True],
            name=f"{name}_slice",
        )
        expanded = mb.expand_dims(x=sliced, axes=[2], name=f"{name}_expand")
        target = mb.concat(values=[1, KV_HEADS, groups, target_len, HEAD_DIM], axis=0)
        shape = mb.shape(x=expanded)
        reps = mb.real_div(x=mb.select(cond=mb.equal(x=target, y=-1), a=shape, b=target), y=shape)
        tiled = mb.tile(x=expanded, reps=reps, name=f"{name}_tile")
        return mb.reshape(x=tiled, shape=[1, heads, -1, HEAD_DIM], name=f"{name}_repeated")

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def attention(q, k_cache, v_cache, mask, other):
        mask_shape = mb.shape(x=mask)
        end = mb.gather(
            x=mask_shape if mask_length == "same" else mb.shape(x=other),
            indices=3 if mask_length == "same" else 1,
            axis=0,
        )
        target_len = end if reps_length == "same" else mb.gather(x=mask_shape, indices=2, axis=0)
        keys, values = repeat(k_cache, end, target_len, "k"), repeat(v_cache, end, target_len, "v")
        scores = mb.mul(x=mb.matmul(x=q, y=keys, transpose_y=True), y=np.float32(1 / math.sqrt(HEAD_DIM)))
        probs = mb.softmax(x=mb.add(x=scores, y=mask), axis=-1)
        return mb.matmul(x=probs, y=values)

    if bounded:
        declare_ranges(attention, {str(s): (1, MAX_LENGTH) for s in (length, cache_len, other_len)})
    return attention
