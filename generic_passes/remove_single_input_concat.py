"""``generic::remove_single_input_concat``: a ``concat`` of one tensor is that tensor.

Where it comes from: ``transformers``' ``DynamicCache.update`` concatenates the cached keys (and values)
with the new ones, ``torch.cat([cache, new], dim=-2)``; with an empty cache coremltools drops the
empty operand and leaves ``concat(values=(new,), axis=-2)``, two per attention layer in every CausalLM
called through its own ``forward``. coremltools' ``noop_elimination`` does not remove it.

Math: concatenating one tensor along any axis copies it: the output equals the input. ::

    x --> concat(values=(x,), axis) --> y      becomes      x --> y

Conditions: the output has the input's shape and dtype, and is not a block output (renaming a block
output to the input's name would change the function's interface; coremltools leaves those too).
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import Pattern, predicates, register_generic_pass

__all__ = ["single_concat_pattern", "single_concat_constraints", "transform_single_concat"]


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol()))])
def single_concat_pattern(x):
    return mb.concat(values=[x], axis=0, name="concat")


def single_concat_constraints(pattern: Pattern) -> bool | tuple[bool, str]:
    """Same shape and dtype in and out, and the output is not a block output."""
    x, y = pattern.root_var, pattern.concat.outputs[0]
    if x.shape != y.shape or x.dtype != y.dtype:
        return False, "the concat changes the shape or dtype"
    if not predicates.not_block_output([pattern.concat]):
        return False, "the concat is a block output"
    return True


def transform_single_concat(pattern: Pattern) -> None:
    """Every user of the concat reads its input."""
    pattern.replace_output(pattern.root_var)


register_generic_pass(
    ops_arrangement=single_concat_pattern,
    var_constraints=single_concat_constraints,
    transform_pattern=transform_single_concat,
    pass_name="remove_single_input_concat",
    namespace="generic",
    name="single_input_concat",
    run_after="common::fuse_layernorm_or_instancenorm",
)
