"""The :class:`~pattern_infra.language.pattern.Pattern` of a complete binding of one spelling
(:func:`build_pattern`): its ops and operands by pattern op name, its constants, and its choices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var

from ..language.pattern import Pattern
from ..language.variants import Variant
from .plan import slot_value

__all__ = ["build_pattern"]


def build_pattern(
    variant: Variant,
    block: Block,
    ops: list[Any],
    assign: list[dict[str, Any] | None],
    roots: list[Var | None],
    order: Callable[[list[Operation]], list[Operation]] | None,
) -> Pattern:
    """The :class:`Pattern` of a complete binding.

    Args:
        variant: The spelling matched.
        block: The block searched.
        ops: Per op of the spelling, the bound program op (a list for a fan-out op).
        assign: Per op of the spelling, its operands as assigned (after any x/y swap).
        roots: Per pattern input, the bound program variable (None where the spelling reads none).
        order: Sorts ops into program order, for ``Pattern.op_list``.
    """
    compiled = variant.compiled
    by_name: dict[str, Any] = {}
    operands: dict[str, dict[str, Any]] = {}
    for name, op, slots in zip(compiled.node_names, ops, assign):
        by_name[name] = op
        operands[name] = dict(slots)  # type: ignore[arg-type]
        for choice in variant.aliases.get(name, ()):  # pattern.<choice>: the op computing its variable
            by_name[choice] = op
    consts: dict[str, Var] = {}
    for (n, slot, pos), key, cname in zip(compiled.const_slots, compiled.const_keys, compiled.const_names):
        var = slot_value(assign, n, slot, pos)
        if var is not None:  # absent: a wildcard slot the matched alternative op type does not have
            consts[key] = var
            consts.setdefault(cname, var)
    if any(type(op) is list for op in ops):  # a fan-out op: the constructor flattens its list
        pattern = Pattern(compiled=compiled, ops=by_name, root_vars=list(roots), block=block, operands=operands,
                          consts=consts, order=order)
        pattern.choices = variant.choices
        return pattern
    return Pattern._of_search(compiled, block, by_name, list(roots), operands, consts, order, compiled.final_names,
                              variant.choices)
