"""A pattern's spellings, each a plain pattern: every choice (``one_of``, ``optional``, ``equivalences=``)
expanded when the pattern compiles.

A pattern with choices stands for the product of their alternatives, nested choices included.
:func:`variants_of` compiles each spelling as a plain pattern (a :class:`Variant`): the pattern's ops less
the alternatives not taken, a choice's variable read as the one its alternative computes. The search
merges the variants' plans into one tree per anchor, so what the spellings share is searched once.

A choice ending its pattern, taken at a later alternative, is refused when an earlier alternative
matches further down with the choice's op inside (a :class:`Guard`: the longest spelling wins); with
``fallback=True`` not when the choice is reached from one of its inputs rather than as the anchor.
A pattern of more than :data:`MAX_VARIANTS` spellings is refused when it compiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coremltools.converters.mil.mil import Var

from .choices import Record
from .compiler import compile_spelling, renamed
from .errors import PatternDefinitionError
from .graph import Choice, CompiledPattern
from .spelling import Spelling, spelling_of

__all__ = ["MAX_VARIANTS", "Guard", "Variant", "has_fallback", "variants_of"]

MAX_VARIANTS = 256
"""The most spellings one pattern may stand for (the product of its choices' alternatives)."""


@dataclass(frozen=True)
class Guard:
    """A choice ending its pattern (or alternative), taken at a later alternative than its first."""

    choice: Choice
    alternative: int
    """The alternative the variant took; the earlier ones are searched by the guard."""
    end: str
    """The variant's op computing the choice's variable."""
    fallback: bool
    """The choice's ``fallback``."""


@dataclass(frozen=True)
class Variant:
    """One spelling of a pattern, as a plain pattern."""

    compiled: CompiledPattern
    """The spelling: no choice node."""
    choices: Spelling
    """``pattern.choices`` of its matches."""
    aliases: dict[str, tuple[str, ...]]
    """Op name to the choices whose variable it computes, innermost first (``pattern.<choice>``)."""
    groups: dict[str, str]
    """Op name to the outermost choice it belongs to (ops outside every choice absent)."""
    guards: tuple[Guard, ...] = ()
    within: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Op name to its innermost choice and the alternative taken there in words, for ``explain``."""


@dataclass
class _Combo:
    """What taking one alternative of each choice of a level means for its ops."""

    chosen: dict[str, int] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)
    renames: dict[int, Var] = field(default_factory=dict)
    ends: list[tuple[str, Var]] = field(default_factory=list)
    guards: list[tuple[Choice, int, Var, bool]] = field(default_factory=list)
    within: dict[str, tuple[str, str]] = field(default_factory=dict)


def variants_of(compiled: CompiledPattern) -> list[Variant]:
    """The spellings of ``compiled`` (itself, without choices), the first choice's first alternative
    first, built once.

    Raises:
        PatternDefinitionError: The pattern stands for more than :data:`MAX_VARIANTS` spellings.
    """
    if compiled.expanded is None:
        compiled.expanded = _expand(compiled)
    return compiled.expanded  # type: ignore[no-any-return]


def has_fallback(compiled: CompiledPattern) -> bool:
    """Whether a choice of ``compiled``, at any depth, was declared with ``fallback=True``."""
    return any(guard.fallback for variant in variants_of(compiled) for guard in variant.guards)


def _expand(compiled: CompiledPattern) -> list[Variant]:
    _, records, _ = compiled.source
    if all(node.choice is None for node in compiled.nodes):
        return [Variant(compiled, spelling_of(compiled, {}), {}, {})]
    count = _count(compiled)
    if count > MAX_VARIANTS:
        raise PatternDefinitionError(
            f"Pattern {compiled.name!r} stands for {count} spellings (the product of its choices' "
            f"alternatives); at most {MAX_VARIANTS} are searched. Rule: every spelling is compiled as a "
            f"pattern of its own. Fix: register the pattern's parts as separate patterns (a list of patterns "
            f"in one register_generic_pass call), or name fewer ops in equivalences=.")
    variants = []
    for combo in _combos(compiled, records):
        aliases: dict[str, tuple[str, ...]] = {}
        for choice, var in combo.ends:
            end = renamed(var, combo.renames).op.name
            aliases[end] = (*aliases.get(end, ()), choice)
        groups = {op.name: record.name for record in records if record.name in combo.chosen
                  for op in record.alternatives[combo.chosen[record.name]][0]}
        guards = tuple(Guard(choice, k, renamed(var, combo.renames).op.name, fallback)
                       for choice, k, var, fallback in combo.guards)
        variants.append(Variant(compile_spelling(compiled, combo.dropped, combo.renames),
                                spelling_of(compiled, combo.chosen), aliases, groups, guards, combo.within))
    return variants


def _count(compiled: CompiledPattern) -> int:
    return math.prod(sum(_count(a.compiled) for a in node.choice.alternatives)
                     for node in compiled.nodes if node.choice is not None)


def _combos(level: CompiledPattern, records: list[Record]) -> list[_Combo]:
    """Every way of taking one alternative of each choice of ``level`` (and of the choices nested in the
    alternatives taken), the first choice's alternatives outermost."""
    combos = [_Combo()]
    for record in records:
        if record.name not in level.by_name:
            continue
        node = level.node(record.name)
        first_out = record.alternatives[0][1]
        grown = []
        for combo in combos:
            for k, (ops, out) in enumerate(record.alternatives):
                alternative = node.choice.alternatives[k]
                others = {id(op) for j, (alt_ops, _) in enumerate(record.alternatives) if j != k for op in alt_ops}
                for inner in _combos(alternative.compiled, record.children.get(k, [])):
                    renames = {**combo.renames, **inner.renames}
                    if k:
                        renames[id(first_out)] = out
                    guards = list(combo.guards) + inner.guards
                    if node.is_final and k:
                        guards.append((node.choice, k, out, record.fallback))
                    within = {**combo.within, **{op.name: (record.name, alternative.label) for op in ops},
                              **inner.within}
                    grown.append(_Combo({**combo.chosen, record.name: k, **inner.chosen},
                                        combo.dropped | inner.dropped | others, renames,
                                        combo.ends + inner.ends + [(record.name, out)], guards, within))
        combos = grown
    return combos

