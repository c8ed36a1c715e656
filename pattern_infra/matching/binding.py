"""The :class:`~pattern_infra.language.pattern.Pattern` of a complete binding (:func:`build_pattern`), the
dicts it holds (:func:`match_dicts`), and the sub-matches of choices (:class:`SubMatch`) merged into them
(:func:`merged`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var

from ..language.pattern import Pattern
from ..language.graph import Alternative, CompiledPattern
from ..language.spelling import Spelling, spelling_of
from .plan import slot_value

__all__ = ["SubMatch", "build_pattern", "lean", "match_dicts", "merged"]


class SubMatch:
    """One complete match of one alternative, ending at the op computing the choice's variable.

    Kept as the search's state (a few list copies); the alternative's ops, operands and constants are
    written into dicts only when a whole match is built (:meth:`parts`).
    """

    __slots__ = ("alternative", "slots", "ops", "end", "choice", "_compiled", "_state", "_parts", "_const_vars")

    def __init__(self, alternative: Alternative, state: tuple[list, list, list, list], choice: str) -> None:
        ops, assign, roots, subs = state
        self.alternative: int = alternative.index
        """Index of the alternative that matched."""
        self.slots: dict[str, Var] = {slot: var for slot, var in zip(alternative.slots, roots) if var is not None}
        """Choice-node slot to the program variable the alternative read there (slots it does not read
        are absent)."""
        flat = [op for op, sub in zip(ops, subs) if sub is None]
        for sub in subs:
            if sub is not None:
                flat.extend(sub.ops)  # includes the op of its choice node (its end)
        self.ops: list[Operation] = flat
        """Every program op of the sub-match (nested choices' included), each once."""
        self.end: Operation = ops[alternative.compiled.final_nodes[0]]
        """The op computing the choice's variable (the alternative's last op)."""
        self.choice: str = choice
        """The choice's name."""
        self._compiled = alternative.compiled
        self._state = state
        self._parts: Any = None
        self._const_vars: list[Var] | None = None

    def parts(self) -> tuple[dict[str, Operation], dict[str, dict[str, Any]], dict[str, Var], dict[str, int]]:
        """The alternative's ops, operands and constants by name, and its nested choices, as a Pattern
        of it would hold them (``binding.match_dicts``), built on first use."""
        if self._parts is None:
            ops, assign, _, subs = self._state
            self._parts = match_dicts(self._compiled, ops, assign, subs)
        return self._parts

    def const_vars(self) -> list[Var]:
        """The program variables in the alternative's constant slots (nested choices' included)."""
        if self._const_vars is not None:
            return self._const_vars
        ops, assign, roots, subs = self._state
        out = [v for n, slot, pos in self._compiled.const_slots
               if (v := slot_value(assign, n, slot, pos)) is not None]
        for sub in subs:
            if sub is not None:
                out.extend(sub.const_vars())
        return out


def build_pattern(
    compiled: CompiledPattern,
    block: Block,
    ops: list[Any],
    assign: list[dict[str, Any] | None],
    roots: list[Var | None],
    order: Callable[[list[Operation]], list[Operation]] | None,
    subs: list[SubMatch | None] | None = None,
) -> Pattern:
    """The :class:`Pattern` of a complete binding.

    Args:
        compiled: The pattern matched.
        block: The block searched.
        ops: Per pattern op, the bound program op (a list for a fan-out op).
        assign: Per pattern op, its operands as assigned (after any x/y swap).
        roots: Per root, the bound program variable.
        order: Sorts ops into program order, for ``Pattern.op_list``.
        subs: Per pattern op, the sub-match of a choice node (None elsewhere).
    """
    by_name, operands, consts, chosen = match_dicts(compiled, ops, assign, subs)
    spelling = lean(compiled, operands, chosen) if chosen is not None else {}
    if any(type(op) is list for op in ops):  # a fan-out op: the constructor flattens its list
        pattern = Pattern(compiled=compiled, ops=by_name, root_vars=list(roots), block=block, operands=operands,
                          consts=consts, order=order)
        pattern.choices = spelling
        return pattern
    # the dicts are fresh: the search's constructor takes them without copies
    return Pattern._of_search(compiled, block, by_name, list(roots), operands, consts, order, compiled.final_names,
                              spelling)


def lean(compiled: CompiledPattern, operands: dict[str, dict[str, Any]], chosen: dict[str, int]) -> Spelling:
    """``pattern.choices`` of a match whose choices took ``chosen`` (a :class:`~pattern_infra.language.spelling.Spelling`,
    shared), the choices' own operands, which it locates, taken out of the match's ``operands``."""
    spelling = spelling_of(compiled, chosen)
    for name in spelling.slots:
        operands.pop(name, None)
    return spelling


def match_dicts(
    compiled: CompiledPattern,
    ops: list[Any],
    assign: list[dict[str, Any] | None],
    subs: list[SubMatch | None] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Var], dict[str, int] | None]:
    """The dicts a :class:`Pattern` of a complete binding holds: ops and operands by pattern op name,
    constants by key, and ``pattern.choices`` (None for a pattern without choices); the sub-matches'
    are merged in (:func:`merged`)."""
    names = compiled.node_names
    by_name = dict(zip(names, ops))
    operands = {name: dict(slots) for name, slots in zip(names, assign)}  # type: ignore[arg-type]
    consts: dict[str, Var] = {}
    for (n, slot, pos), key, cname in zip(compiled.const_slots, compiled.const_keys, compiled.const_names):
        var = slot_value(assign, n, slot, pos)
        if var is None:
            continue  # a wildcard slot the matched alternative op does not have
        consts[key] = var
        consts.setdefault(cname, var)
    if subs is None or not compiled.has_choices:
        return by_name, operands, consts, None
    return by_name, operands, consts, merged(by_name, operands, consts, subs)


def merged(
    ops: dict[str, Any], operands: dict[str, dict[str, Any]], consts: dict[str, Var], subs: Sequence[SubMatch | None]
) -> dict[str, int]:
    """Adds the sub-matches' ops, operands and constants to a match's dicts; returns ``pattern.choices``
    (choice name to the index of the alternative that matched, nested choices included). The ops of an
    alternative go right before its choice's entry, so the dict stays in a topological order (the
    driver removes dead ops in its reverse)."""
    chosen: dict[str, int] = {}
    by_choice = {sub.choice: sub for sub in subs if sub is not None}
    outer = list(ops.items())
    ops.clear()
    for name, op in outer:  # each alternative's ops right before its choice: a topological order still
        sub = by_choice.get(name)
        if sub is not None:
            for inner_name, inner_op in sub.parts()[0].items():
                ops.setdefault(inner_name, inner_op)
        ops.setdefault(name, op)
    for sub in subs:
        if sub is None:
            continue
        _, inner_operands, inner_consts, inner_chosen = sub.parts()
        for name, slots in inner_operands.items():
            operands.setdefault(name, slots)
        for key, var in inner_consts.items():
            consts.setdefault(key, var)
        chosen[sub.choice] = sub.alternative
        if inner_chosen:
            chosen.update(inner_chosen)
    return chosen
