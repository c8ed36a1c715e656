"""The :class:`~pattern_infra.pattern.Pattern` of a complete binding, built alike by the interpreter, the
generated search and the choices' sub-matches: :func:`build_pattern`, the dicts it holds
(:func:`match_dicts`) and the sub-matches of choices merged into them (:func:`merged`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from coremltools.converters.mil.mil import Block, Operation, Var

from .pattern import Pattern
from .plan import slot_value
from .spelling import Spelling, spelling_of

if TYPE_CHECKING:
    from .choice_search import SubMatch
    from .compiler import CompiledPattern
    from .matcher import Matcher

__all__ = ["build_pattern", "lean", "match_dicts", "merged", "new_pattern", "pattern_of"]


def build_pattern(
    matcher: Matcher,
    block: Block,
    ops: list[Any],
    assign: list[dict[str, Any] | None],
    roots: list[Var | None],
    order: Callable[[list[Operation]], list[Operation]] | None,
    subs: list[SubMatch | None] | None = None,
) -> Pattern:
    """The :class:`Pattern` of a complete binding (interpreter and compiled searches alike).

    Args:
        matcher: The matcher that found it.
        block: The block searched.
        ops: Per pattern op, the bound program op (a list for a fan-out op).
        assign: Per pattern op, its operands as assigned (after any x/y swap).
        roots: Per root, the bound program variable.
        order: Sorts ops into program order, for ``Pattern.op_list``.
        subs: Per pattern op, the sub-match of a choice node (None elsewhere).
    """
    by_name, operands, consts, chosen = match_dicts(matcher, ops, assign, subs)
    compiled = matcher.compiled
    spelling = lean(compiled, operands, chosen) if chosen is not None else {}
    if any(type(op) is list for op in ops):  # a fan-out op: the constructor flattens its list
        pattern = new_pattern(compiled, block, by_name, roots, operands, consts, order)
        pattern.choices = spelling
        return pattern
    # the dicts are fresh: the compiled search's constructor takes them without copies
    return Pattern._of_search(compiled, block, by_name, list(roots), operands, consts, order, compiled.final_names,
                              spelling)


def lean(compiled: CompiledPattern, operands: dict[str, dict[str, Any]], chosen: dict[str, int]) -> Spelling:
    """``pattern.choices`` of a match whose choices took ``chosen`` (a :class:`~pattern_infra.spelling.Spelling`,
    shared), the choices' own operands, which it locates, taken out of the match's ``operands``."""
    spelling = spelling_of(compiled, chosen)
    for name in spelling.slots:
        operands.pop(name, None)
    return spelling


def pattern_of(compiled: CompiledPattern, block: Block, ops: dict[str, Any], roots: list[Var],
               operands: dict[str, dict[str, Any]], consts: dict[str, Var],
               order: Callable[[list[Operation]], list[Operation]] | None, chosen: dict[str, int]) -> Pattern:
    """The Pattern of a generated search's match whose choices' dicts were merged at run time (the
    operands of a sub-match built by the interpreter hold its nested choices': :func:`lean` takes them out)."""
    return Pattern._of_search(compiled, block, ops, roots, operands, consts, order, compiled.final_names,
                              lean(compiled, operands, chosen))


def match_dicts(
    matcher: Matcher,
    ops: list[Any],
    assign: list[dict[str, Any] | None],
    subs: list[SubMatch | None] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Var], dict[str, int] | None]:
    """The dicts a :class:`Pattern` of a complete binding holds: ops and operands by pattern op name,
    constants by key, and ``pattern.choices`` (None for a pattern without choices); the sub-matches'
    are merged in (:func:`merged`)."""
    compiled = matcher.compiled
    names = compiled.node_names
    by_name = dict(zip(names, ops))
    operands = {name: dict(slots) for name, slots in zip(names, assign)}  # type: ignore[arg-type]
    consts: dict[str, Var] = {}
    for (n, slot, pos), key, cname in zip(matcher.const_slots, compiled.const_keys, compiled.const_names):
        var = slot_value(assign, n, slot, pos)
        if var is None:
            continue  # a wildcard slot the matched alternative op does not have
        consts[key] = var
        consts.setdefault(cname, var)
    if subs is None or not matcher.has_choices:
        return by_name, operands, consts, None
    return by_name, operands, consts, merged(by_name, operands, consts, subs)


def new_pattern(
    compiled: CompiledPattern,
    block: Block,
    ops: dict[str, Any],
    roots: list[Var | None],
    operands: dict[str, dict[str, Any]],
    consts: dict[str, Var],
    order: Callable[[list[Operation]], list[Operation]] | None,
) -> Pattern:
    """The one ``Pattern`` constructor call of both searches (the compiled one builds the dicts inline)."""
    return Pattern(
        compiled=compiled,
        ops=ops,
        root_vars=list(roots),
        block=block,
        operands=operands,
        consts=consts,
        order=order,
    )


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
