"""``generic::remove_unit_tile``: a ``tile`` whose reps are proven all ones is its input.

Where it comes from: an in-place cache update ``cache[..., begin:end, :] = k`` exported with flexible
lengths and converted with coremltools' own ``copy`` converter. ``torch.export`` writes the update as
``copy`` of ``k`` into the slice; coremltools broadcasts ``k`` and the slice both ways when their shapes
are different symbols, and takes the target's size from one of them in set order (so from
``PYTHONHASHSEED``), with a ``tile`` whose reps are computed at run time::

    reps = real_div(select(equal(target, -1), shape(k), target), shape(k))
    (target: k's shape or the slice's)

coremltools' ``noop_elimination`` removes a ``tile`` only when its reps are constant ones, which these
are not. (``pattern_infra.pytorch.torch_support.install()`` replaces that converter: it reads the sizes
``torch.export`` proved equal and writes ``k`` as it is, so a conversion with it has none of these tiles.)

Math: tiling by one along every axis copies the tensor. ::

    x --> tile(reps = [1, 1, ..., 1]) --> y      becomes      x --> y

Proof: every rep is proven 1 from the program's shape ops (:mod:`generic_passes._shape_proof`; for
``target = shape(k)`` itself, ``shape(k) / shape(k)``). Decision on the others: where the target is the
shape of a slice ``[S - L, S)`` of the cache, its length is ``L`` only when ``S >= L``, which the MIL
program does not carry (its two lengths are independent inputs, each with its own range; for ``S < L``
the slice is empty and the tile really tiles by 0); that tile stays. ``S >= L`` is a guard of the
export, which only the converter can read.

Conditions: the output is not a block output, and has the input's dtype.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from generic_passes._shape_proof import ShapeFacts
from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["unit_tile_pattern", "unit_tile_constraints", "transform_unit_tile"]


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))])
def unit_tile_pattern(x):
    return mb.tile(x=x, reps=[2, 1], name="tile")


def unit_tile_constraints(pattern: Pattern) -> bool | str:
    """Reps proven all ones, same dtype, not a block output."""
    tile = pattern.tile
    if tile.outputs[0].dtype != tile.x.dtype or not predicates.not_block_output([tile]):
        return "the tile changes the dtype or is a block output"
    reps = ShapeFacts.of(pattern.block).values(tile.reps)
    if reps is None or len(reps) != tile.x.rank or any(r != 1 for r in reps):
        return "reps not proven all ones"
    return True


def transform_unit_tile(pattern: Pattern) -> None:
    """Every user of the tile reads its input."""
    pattern.replace_output(pattern.tile.x)


register_generic_pass(
    ops_arrangement=unit_tile_pattern,
    var_constraints=unit_tile_constraints,
    transform_pattern=transform_unit_tile,
    pass_name="remove_unit_tile",
    namespace="generic",
    name="unit_tile",
    run_after="common::fuse_layernorm_or_instancenorm",
)
