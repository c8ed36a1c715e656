"""Matching a choice node (``one_of``, ``optional``, ``equivalences=``): what the search
(:mod:`~pattern_infra.matching.search`) calls at a choice point, anchored at the op computing the
choice's variable (:func:`choice_matches`) or entered from the variable of one of its slots
(:func:`entered_matches`). Each alternative is searched by the running search
(``outer.sub_search``), which hands every sub-match (:class:`~pattern_infra.matching.binding.SubMatch`)
to the rest of the outer search the moment it finds it (``take``, continuation passing), so no
alternative is searched further than the first match taken needs. The checks of a whole match that has
sub-matches are here too (:func:`subs_final_ok`). The pattern language itself is
:mod:`~pattern_infra.language.choices`.

``outer`` is always the running :class:`~pattern_infra.matching.search.Search` (this module is below it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from coremltools.converters.mil.mil import Operation, Var

from ..language.graph import Alternative, Choice, CompiledPattern
from .binding import SubMatch
from .plan import Failure, entry_types

__all__ = ["all_op_types", "candidates_below", "choice_matches", "entered_matches", "has_fallback",
           "subs_final_ok"]

Take = Callable[[Any], Any]
"""What a choice's helpers call with each sub-match found: the rest of the search, continued from it;
a truthy result ends the search and is returned."""



def choice_matches(
    outer: Any, choice: Choice, op: Operation, take: Take, failures: list[str] | None = None, maximal: bool = False,
) -> Any:
    """Offers ``take`` every complete match of every alternative of ``choice`` whose last op is ``op``,
    in order and lazily, each the moment it is found: the first truthy result of ``take`` ends the search
    (the alternative's search unwinds; later sub-matches and alternatives are never searched) and is
    returned; None when ``take`` took none.

    Only the alternatives whose last op accepts ``op``'s type are searched (a dispatch on the op type:
    the others could not bind it), each anchored at its last op; the bind attempts it makes are added to
    the outer matcher's ``bind_attempts``, less the anchor, which the outer search bound and counted
    already.

    Args:
        outer: The running search of the pattern holding the choice node.
        choice: The choice.
        op: The program op offered as the alternatives' last op.
        take: Called with each :class:`SubMatch` (the rest of the outer search, continued from it).
        failures: If given, receives for each alternative without a match ``"<label>: <reason>"`` (the
            alternatives are then searched with tracing, as ``explain`` does).
        maximal: The choice ends the pattern (its variable may be used anywhere): a later alternative is
            left out at ``op`` when an earlier one matches further down with ``op`` inside (the longest
            spelling wins, as with ``optional``: ``norm * w`` is not matched as ``norm`` followed by an
            unrelated ``mul``); checked at the later alternative's first match (:class:`TakenFurther`).
    """
    op_type = op.op_type
    for alternative in choice.alternatives:
        end = alternative.compiled.nodes[alternative.compiled.final_nodes[0]]
        if op_type not in end.op_types:
            if failures is not None:
                failures.append(f"{alternative.label}: ends with {end.op_type_label}, not {op_type}")
            continue
        found: list[SubMatch] = []
        taken = TakenFurther(outer, choice, alternative, op) if maximal and alternative.index > 0 else None

        def each(state: tuple[list, list, list, list], alternative: Alternative = alternative,
                 found: list[SubMatch] = found, taken: TakenFurther | None = taken) -> Any:
            found.append(sub := SubMatch(alternative, state, choice.name))
            return None if taken is not None and taken() else take(sub)

        outer.m.bind_attempts -= 1  # the anchor: bound (and counted) by the outer search
        search = outer.sub_search(alternative, failures is not None, each, op=op)
        if search.result:
            return search.result
        if failures is not None and (not found or taken is not None and taken()):
            failures.append(f"{alternative.label}: " + (_reason(search) if not found
                                                         else "an earlier alternative matches further down"))
    return None


def entered_matches(
    outer: Any, choice: Choice, slot: str, var: Var, take: Take, failures: list[str] | None = None,
    maximal: bool = False,
) -> Any:
    """Offers ``take`` every complete match of every alternative of ``choice`` reading ``var`` in
    ``slot``, lazily as :func:`choice_matches` does, each alternative searched *entered* from ``var``
    (``Matcher.root_plans``): a down-step into a choice binds only the ops below ``var`` that an
    alternative reaches, each once per alternative, where offering every op within the choice's depth
    to every alternative (:func:`candidates_below`) searched again what the alternatives share.
    :func:`~pattern_infra.matching.plan.enterable` says when this applies.

    Args:
        outer: The running search of the pattern holding the choice node.
        choice: The choice.
        slot: The choice node's slot the down-step goes through (every alternative reads it).
        var: The program variable bound to ``slot``.
        take: As for :func:`choice_matches`; ``sub.end`` is the op the choice node binds.
        failures: As for :func:`choice_matches`.
        maximal: The choice ends the pattern: a match of a later alternative is not offered when its
            last op lies inside a match of an earlier alternative found here (the longest spelling wins,
            as in :func:`choice_matches`). Every sub-match of the earlier alternatives is known by then:
            a later alternative is searched only once the earlier ones' searches ran to their end.

    Returns:
        The first truthy result of ``take``, or None.
    """
    maximal = maximal and not choice.fallback
    inside_earlier: set[int] = set()  # ops inside an earlier alternative's sub-match, its last op aside
    types_in = entry_types(choice, slot)
    below = {op.op_type for op in var.child_ops}
    for alternative, types in zip(choice.alternatives, types_in):  # type: ignore[arg-type]
        if below.isdisjoint(types):  # a dispatch on the consumers' types: nothing to enter by
            if failures is not None:
                failures.append(f"{alternative.label}: no consumer of {var.name} is {' or '.join(sorted(types))}")
            continue
        found: list[SubMatch] = []  # every sub-match of this alternative, offered or not
        offered: list[SubMatch] = []

        def each(state: tuple[list, list, list, list], alternative: Alternative = alternative,
                 found: list[SubMatch] = found, offered: list[SubMatch] = offered) -> Any:
            found.append(sub := SubMatch(alternative, state, choice.name))
            if maximal and id(sub.end) in inside_earlier:
                return None  # ends inside an earlier alternative's sub-match: not offered
            offered.append(sub)
            return take(sub)

        search = outer.sub_search(alternative, failures is not None, each, entry=(alternative.slots.index(slot), var))
        if search.result:
            return search.result
        if maximal:
            inside_earlier.update(id(o) for sub in found for o in sub.ops if o is not sub.end)
        if failures is not None and not offered:
            failures.append(f"{alternative.label}: " + ("an earlier alternative matches further down" if found
                                                         else _reason(search)))
    return None


def _reason(search: Any) -> str:
    """Why an alternative's search found nothing: its traced failure, else "no match"."""
    failure = search.failure
    return failure.reason if isinstance(failure, Failure) else "no match"


def taken_further(outer: Any, choice: Choice, alternative: Alternative, op: Operation) -> bool:
    """Whether an alternative before ``alternative`` matches at an op below ``op`` with ``op`` inside."""
    for below in candidates_below(op.outputs[0], choice):
        for earlier in choice.alternatives[: alternative.index]:
            if below.op_type not in earlier.compiled.nodes[earlier.compiled.final_nodes[0]].op_types:
                continue
            states: list[tuple[list, list, list, list]] = []
            outer.sub_search(earlier, False, states.append, op=below)
            for ops, _, _, subs in states:
                if any(o is op for o in ops) or any(sub is not None and any(o is op for o in sub.ops) for sub in subs):
                    return True
    return False


class TakenFurther:
    """:func:`taken_further` of its arguments, computed when first called (at the first match of the later
    alternative: most alternatives find none), then remembered."""

    __slots__ = ("args", "value")

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.value: bool | None = None

    def __call__(self) -> bool:
        if self.value is None:
            self.value = taken_further(*self.args)
        return self.value


def candidates_below(var: Var, choice: Choice) -> list[Operation]:
    """Ops that may compute a choice's variable from ``var`` (a down-step into a choice node): every op
    at most ``choice.depth`` consumer steps below ``var`` whose type an alternative ends with, breadth
    first, each once. The alternatives' own searches check the rest (that the choice really reads
    ``var`` is checked by the outer search, as for any slot)."""
    seen: dict[int, Operation] = {}
    frontier = [var]
    out: list[Operation] = []
    for _ in range(choice.depth):
        next_vars: list[Var] = []
        for v in frontier:
            for op in v.child_ops:
                if id(op) in seen:
                    continue
                seen[id(op)] = op
                if op.op_type in choice.output_types:
                    out.append(op)
                next_vars.extend(op.outputs)
        frontier = next_vars
    return out


def subs_final_ok(ops: Sequence[Any], subs: Sequence[SubMatch | None]) -> bool:
    """The outer final check the alternatives cannot make themselves: no constant slot of a sub-match is
    computed by an op of the match (the outer ops or another sub-match; one computed by an op of its own
    sub-match was refused by that sub-match's search already)."""
    present = [sub for sub in subs if sub is not None]
    return consts_outside(ops, [sub.ops for sub in present], [v for sub in present for v in sub.const_vars()])


def consts_outside(ops: Sequence[Any], op_lists: Sequence[Sequence[Operation]], const_vars: Sequence[Var]) -> bool:
    """Whether no variable of ``const_vars`` is computed by one of ``ops`` (None entries ignored) or of
    the ``op_lists``."""
    # a const op is never part of a match (constants are pattern edges, not pattern ops)
    producers = [p for var in const_vars if (p := var._op) is not None and type(p).__name__ != "const"]
    if not producers:
        return True
    inside = {id(op) for op in ops if op is not None}
    for listed in op_lists:
        inside.update(id(op) for op in listed)
    return not any(id(p) in inside for p in producers)


def all_op_types(compiled: CompiledPattern) -> frozenset[str]:
    """Every op type a match of ``compiled`` may contain, the alternatives' (nested) included."""
    types: set[str] = set()
    for node in compiled.nodes:
        if node.choice is None:
            types |= node.op_types
        else:
            for alternative in node.choice.alternatives:
                types |= all_op_types(alternative.compiled)
    return frozenset(types)


def has_fallback(compiled: CompiledPattern) -> bool:
    """Whether ``compiled`` has a ``fallback`` choice, at any depth of its alternatives."""
    return any(
        node.choice is not None
        and (node.choice.fallback or any(has_fallback(a.compiled) for a in node.choice.alternatives))
        for node in compiled.nodes
    )
