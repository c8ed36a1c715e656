"""``common::merge_consecutive_relus``: ``relu(relu(x))`` into ``relu(x)``, for chains of any length.

Math: ``relu`` is idempotent, ``relu(relu(x)) = relu(x)``::

    x --> relu --> relu --> y

    becomes:

    x --> relu --> y

As in coremltools, the first ``relu`` stays (with its name), the uses of the second one's output read the
first one's output instead, and the second ``relu`` is removed. The first ``relu`` must have exactly one
consumer, the second ``relu``: a ``relu`` feeding two ``relu`` ops (or a ``relu`` and anything else) is
left as it is, as coremltools leaves it. A chain ``relu -> relu -> ... -> relu`` needs no pattern of its
own: each rewrite makes the next ``relu`` read the first one, and the driver revisits the ops a rewrite
touched, so the chain collapses to one ``relu`` in one pass.

Why the pattern is the second ``relu`` alone, with the first one as its input variable: the first
``relu`` is kept, so being a block output does not stop coremltools from merging (the block keeps
reading it), whereas the matcher never lets an intermediate of a pattern be a block output.
``var_constraints`` therefore checks the first ``relu`` itself: a ``relu`` in the same block whose only
consumer is the second one, and coremltools' ``Var.can_be_replaced_by_var`` condition.

One refusal is added: when both ``relu`` outputs are block outputs, coremltools merges them into one
variable, so the block returns the same variable twice and one output name is lost (``(%r2, %first)``
becomes ``(%r2, %r2)``); we leave that last pair alone.
"""

from __future__ import annotations

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Var, get_new_symbol

from pattern_infra import Pattern, register_generic_pass

__all__ = ["relu_of_relu_pattern", "follows_single_use_relu", "transform_merge_relus"]

_SHAPE = [get_new_symbol(), get_new_symbol(), get_new_symbol()]


@mb.program(input_specs=[mb.TensorSpec(shape=_SHAPE)])
def relu_of_relu_pattern(x):
    return mb.relu(x=x, name="relu2")


def _is_block_output(var: Var, pattern: Pattern) -> bool:
    return any(out is var for out in pattern.block.outputs)


def follows_single_use_relu(pattern: Pattern) -> bool | tuple[bool, str]:
    """The input is a ``relu`` of the same block used only here, and the merge keeps every output.

    Returns:
        True, or ``(False, reason)``.
    """
    first_out, second_out = pattern.root_var, pattern.relu2.outputs[0]
    first = first_out.op
    if first is None or first.op_type != "relu" or first.enclosing_block is not pattern.block:
        return False, "the input is not a relu of the same block"
    if len(first_out.child_ops) != 1:
        return False, "the first relu has other users"
    if _is_block_output(first_out, pattern) and _is_block_output(second_out, pattern):
        return False, "both relus are block outputs"
    if not second_out.can_be_replaced_by_var(first_out):
        return False, "the second relu's output cannot be replaced by the first's"
    return True


def transform_merge_relus(pattern: Pattern) -> None:
    """Redirects the uses of the second ``relu`` to the first; the framework removes the second."""
    pattern.replace_output(pattern.root_var)


register_generic_pass(
    ops_arrangement=relu_of_relu_pattern,
    var_constraints=follows_single_use_relu,
    transform_pattern=transform_merge_relus,
    pass_name="merge_consecutive_relus",
    namespace="common",
    name="consecutive_relus",
)
