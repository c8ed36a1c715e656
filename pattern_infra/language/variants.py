"""A pattern's spellings: :func:`combos` lists the ways of taking one alternative of each choice, a
:class:`Guard` keeps the longest spelling (docs/ARCHITECTURE.md, "Alternatives")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NoReturn

from coremltools.converters.mil.mil import Var

from .choices import Record, Region
from .graph import CompiledPattern, operands

__all__ = ["MAX_VARIANTS", "Guard", "Spelling", "Variant", "combos", "count", "renamed"]

MAX_VARIANTS = 256
"""The most spellings one pattern may stand for (the product of its choices' alternatives)."""


class Spelling(dict[str, int]):
    """``pattern.choices``: choice name (nested ones included) to the index of the alternative matched;
    read-only, shared by the matches of one spelling."""

    slots: dict[str, dict[str, tuple[str, str, int]]]
    """Per choice: slot to the operand holding it (op name, op slot, tuple position or -1): ``operand()``."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "pattern.choices is shared by every match of the same spelling and cannot be "
            "changed; copy it first: dict(pattern.choices)"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __init__(self, chosen: Mapping[str, int], slots: dict[str, dict[str, tuple[str, str, int]]]) -> None:
        super().__init__(chosen)
        self.slots = slots

    def __reduce__(self) -> tuple[Any, ...]:  # copy, deepcopy and pickle: a Spelling again
        return Spelling, (dict(self), self.slots)


@dataclass(frozen=True)
class Guard:
    """A choice ending its pattern (or alternative), taken at a later alternative than its first."""

    choice: str
    alternative: int
    """The alternative the variant took."""
    end: str
    """The variant's op computing the choice's variable."""
    fallback: bool
    earlier: tuple[CompiledPattern, ...]
    """The alternatives before the one taken, each compiled as a pattern of the choice's slots."""
    depth: int
    """Most ops on a path through an earlier alternative: how far below the end its match may end."""
    output_types: frozenset[str]
    """The op types an earlier alternative ends with."""


@dataclass
class Variant:
    """One spelling of a pattern: one alternative of each choice, and the plain pattern it compiles to."""

    chosen: dict[str, int] = field(default_factory=dict)
    """Choice name to the index of the alternative taken."""
    dropped: set[int] = field(default_factory=set)
    """``id`` of the ops of the alternatives not taken."""
    renames: dict[int, Var] = field(default_factory=dict)
    """``id`` of a choice's variable (its first alternative's) to the variable of the alternative taken."""
    ends: list[tuple[Record, int, Var]] = field(default_factory=list)
    """The choices ending the pattern taken at a later alternative than their first: its guards to be."""
    within: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Op name to its innermost choice and the alternative taken there in words, for ``explain``."""
    groups: dict[str, str] = field(default_factory=dict)
    """Op name to the outermost choice it belongs to (ops outside every choice absent)."""
    taken: list[tuple[str, Region]] = field(default_factory=list)
    compiled: CompiledPattern = field(init=False)
    """The spelling as a plain pattern (set by the compiler)."""
    guards: tuple[Guard, ...] = ()
    """One per ``ends`` (set by the compiler)."""

    @cached_property
    def choices(self) -> Spelling:
        """``pattern.choices`` of its matches, with the operand holding each slot of each choice taken."""
        slots = {}
        for choice, region in self.taken:
            names = {id(var): slot for slot, var in region.inputs.items()}
            held: dict[str, tuple[str, str, int]] = {}
            for op in region.operations:
                if id(op) not in self.dropped:
                    for op_slot, pos, v in operands(op):
                        if id(v) in names:
                            held.setdefault(names[id(v)], (op.name, op_slot, pos))
            slots[choice] = {slot: held[slot] for slot in region.inputs if slot in held}
        return Spelling(self.chosen, slots)

    @cached_property
    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Op name to the choices whose variable it computes, innermost first (``taken``: outermost first)."""
        aliases: dict[str, tuple[str, ...]] = {}
        for choice, region in self.taken:
            end = renamed(region.outputs[0], self.renames).op.name
            aliases[end] = (choice, *aliases.get(end, ()))
        return aliases


def combos(records: list[Record], outputs: list[Var], regions: Mapping[int, list[Region]]) -> list[Variant]:
    """Every way of taking one alternative of each choice of ``records`` (and of the choices nested in the
    alternatives taken), the first choice's alternatives outermost; ``outputs``: the level's outputs."""
    result = [Variant()]
    for record in (r for r in records if id(r) in regions):
        first_out = record.alternatives[0][1]
        final = any(out is first_out for out in outputs)
        grown = []
        for combo in result:
            for k, (ops, out) in enumerate(record.alternatives):
                region = regions[id(record)][k]
                others = {
                    id(op) for j, (alt_ops, _) in enumerate(record.alternatives) if j != k for op in alt_ops
                }
                for inner in combos(record.children.get(k, []), [out], regions):
                    renames = {**combo.renames, **inner.renames}
                    if k:
                        renames[id(first_out)] = out
                    grown.append(
                        Variant(
                            {**combo.chosen, record.name: k, **inner.chosen},
                            combo.dropped | inner.dropped | others,
                            renames,
                            combo.ends + inner.ends + ([(record, k, out)] if final and k else []),
                            {
                                **combo.within,
                                **{op.name: (record.name, region.label) for op in ops},
                                **inner.within,
                            },
                            {**combo.groups, **{op.name: record.name for op in ops}},
                            combo.taken + [(record.name, region)] + inner.taken,
                        )
                    )
        result = grown
    return result


def count(records: list[Record], regions: Mapping[int, list[Region]]) -> int:
    """How many spellings ``records`` stand for."""
    return math.prod(
        sum(count(r.children.get(k, []), regions) for k in range(len(r.alternatives)))
        for r in records
        if id(r) in regions
    )


def renamed(var: Var, renames: Mapping[int, Var] | None) -> Var:
    """``var``, or the variable a spelling reads in its place (``renames`` followed to the end)."""
    while renames and id(var) in renames:
        var = renames[id(var)]
    return var
