"""Matching a choice node (``one_of``, ``optional``, ``equivalences=``): what the interpreter
(:mod:`~pattern_infra.interpreter`) calls at a choice point (:func:`choice_matches`, or entered from the
slot's variable, :func:`entered_matches`): each alternative's search, which hands every sub-match
(:class:`SubMatch`) to the rest of the outer search the moment it finds it (``take``, continuation
passing), so no alternative is searched further than the first match taken needs; and the checks of a
whole match that has sub-matches, which the generated search uses too (it writes the alternatives'
searches into its own: :mod:`~pattern_infra.codegen_choices`, and calls :func:`choice_matches` /
:func:`entered_matches` only for an alternative it cannot write). The pattern language itself is
:mod:`~pattern_infra.choices`.

This module does not import the matcher (which imports it): it reaches the matcher's class and its
interpreter through the matcher objects it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from coremltools.converters.mil.mil import Operation, Var

from .binding import match_dicts
from .choices import Alternative, Choice
from .plan import Failure, slot_value

if TYPE_CHECKING:
    from .compiler import CompiledPattern

Take = Callable[[Any], Any]
"""What a choice's helpers call with each sub-match found: the rest of the search, continued from it;
a truthy result ends the search and is returned."""



class SubMatch:
    """One complete match of one alternative, ending at the op computing the choice's variable.

    Kept as the search's state (a few list copies); the alternative's ops, operands and constants are
    written into dicts only when a whole match is built (:meth:`parts`).
    """

    __slots__ = ("alternative", "slots", "ops", "end", "choice", "_matcher", "_state", "_parts", "_const_vars")

    def __init__(self, alternative: Alternative, matcher: Any, state: tuple[list, list, list, list],
                 choice: str) -> None:
        ops, assign, roots, subs = state
        self.alternative: int = alternative.index
        """Index of the alternative that matched."""
        self.slots: dict[str, Var] = present_slots(alternative.slots, roots)
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
        self._matcher = matcher
        self._state = state
        self._parts: Any = None
        self._const_vars: list[Var] | None = None

    def parts(self) -> tuple[dict[str, Operation], dict[str, dict[str, Any]], dict[str, Var], dict[str, int]]:
        """The alternative's ops, operands and constants by name, and its nested choices, as a Pattern
        of it would hold them (``binding.match_dicts``), built on first use."""
        if self._parts is None:
            ops, assign, _, subs = self._state
            self._parts = match_dicts(self._matcher, ops, assign, subs)
        return self._parts

    def const_vars(self) -> list[Var]:
        """The program variables in the alternative's constant slots (nested choices' included)."""
        if self._const_vars is not None:
            return self._const_vars
        ops, assign, roots, subs = self._state
        out = [v for n, slot, pos in self._matcher.const_slots
               if (v := slot_value(assign, n, slot, pos)) is not None]
        for sub in subs:
            if sub is not None:
                out.extend(sub.const_vars())
        return out


def present_slots(slots: Sequence[str], values: Sequence[Var | None]) -> dict[str, Var]:
    """``SubMatch.slots``, of an interpreter's match or of a row: the slots with a variable (an
    alternative may not read some)."""
    return {slot: var for slot, var in zip(slots, values) if var is not None}


def alternative_matcher(outer: Any, alternative: Alternative) -> Any:
    """The alternative's matcher, built on first use as one of the outer matcher's class (this module
    does not import the matcher, which imports it)."""
    matcher = getattr(alternative, "_matcher", None)
    if matcher is None:
        matcher = type(outer)(alternative.compiled)
        alternative._matcher = matcher  # type: ignore[attr-defined]
    return matcher


def choice_matches(
    outer: Any, choice: Choice, op: Operation, block: Any, take: Take, failures: list[str] | None = None,
    maximal: bool = False,
) -> Any:
    """Offers ``take`` every complete match of every alternative of ``choice`` whose last op is ``op``,
    in order and lazily, each the moment it is found: the first truthy result of ``take`` ends the search
    (the alternative's search unwinds; later sub-matches and alternatives are never searched) and is
    returned; None when ``take`` took none.

    Only the alternatives whose last op accepts ``op``'s type are searched (a dispatch on the op type:
    the others could not bind it), each anchored at its last op; the bind attempts it makes are added to
    ``outer.bind_attempts``, less the anchor, which the outer search bound and counted already, so the
    interpreter and the compiled search count the same.

    Args:
        outer: The matcher of the pattern holding the choice node.
        choice: The choice.
        op: The program op offered as the alternatives' last op.
        block: The block searched.
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
        taken = TakenFurther(outer, choice, alternative, op, block) if maximal and alternative.index > 0 else None

        def each(state: tuple[list, list, list, list], alternative: Alternative = alternative,
                 found: list[SubMatch] = found, taken: TakenFurther | None = taken) -> Any:
            found.append(sub := SubMatch(alternative, alternative_matcher(outer, alternative), state, choice.name))
            return None if taken is not None and taken() else take(sub)

        outer.bind_attempts -= 1  # the anchor: bound (and counted) by the outer search
        search = _search_alternative(outer, alternative, op, block, failures is not None, each)
        if search.result:
            return search.result
        if failures is not None and (not found or taken is not None and taken()):
            failures.append(f"{alternative.label}: " + (_reason(search) if not found
                                                         else "an earlier alternative matches further down"))
    return None


def enterable(choice: Choice, slot: str) -> bool:
    """Whether a down-step into ``choice`` through ``slot`` can enter every alternative from the slot's
    variable: every alternative reads the slot, by an op that can start a search (:func:`entry_edge`)."""
    return _entry_types(choice, slot) is not None


def _entry_types(choice: Choice, slot: str) -> list[frozenset[str]] | None:
    """Per alternative, the op types of the op reading ``slot`` that a search entered from it binds
    first (a nested choice: its alternatives' such types); None when not :func:`enterable`."""
    if slot in choice.entries:
        return choice.entries[slot]
    types: list[frozenset[str]] | None = [] if slot in choice.full_slots else None
    for alternative in choice.alternatives if types is not None else ():
        entry = entry_edge(alternative.compiled, alternative.slots.index(slot))
        if entry is None:
            types = None
            break
        node = alternative.compiled.nodes[entry[0]]
        inner = _entry_types(node.choice, entry[1]) if node.choice is not None else [node.op_types]
        types.append(frozenset().union(*inner))  # type: ignore[arg-type]
    choice.entries[slot] = types
    return types


def entry_edge(compiled: CompiledPattern, root: int) -> tuple[int, str, int, int] | None:
    """The first consumer of pattern input ``root`` a search may be entered by, as (node, slot, position,
    root): not a fan-out op, not a tuple slot, and for a choice node a slot it can be entered through
    (:func:`enterable`). None when there is none."""
    for n, slot, pos in compiled.root_consumers[root]:
        node = compiled.nodes[n]
        if node.fanout or pos >= 0:
            continue
        if node.choice is not None and not enterable(node.choice, slot):
            continue
        return (n, slot, pos, root)
    return None


def entered_matches(
    outer: Any, choice: Choice, slot: str, var: Var, block: Any, take: Take, failures: list[str] | None = None,
    maximal: bool = False,
) -> Any:
    """Offers ``take`` every complete match of every alternative of ``choice`` reading ``var`` in
    ``slot``, lazily as :func:`choice_matches` does, each alternative searched *entered* from ``var``
    (``Matcher.root_plans``): a down-step into a choice binds only the ops below ``var`` that an
    alternative reaches, each once per alternative, where offering every op within the choice's depth
    to every alternative (:func:`candidates_below`) searched again what the alternatives share.
    :func:`enterable` says when this applies.

    Args:
        outer: The matcher of the pattern holding the choice node (its ``bind_attempts`` receive the
            alternatives' binds).
        choice: The choice.
        slot: The choice node's slot the down-step goes through (every alternative reads it).
        var: The program variable bound to ``slot``.
        block: The block searched.
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
    entry_types = _entry_types(choice, slot)
    below = {op.op_type for op in var.child_ops}
    for alternative, types in zip(choice.alternatives, entry_types):  # type: ignore[arg-type]
        if below.isdisjoint(types):  # a dispatch on the consumers' types: nothing to enter by
            if failures is not None:
                failures.append(f"{alternative.label}: no consumer of {var.name} is {' or '.join(sorted(types))}")
            continue
        found: list[SubMatch] = []  # every sub-match of this alternative, offered or not
        offered: list[SubMatch] = []

        def each(state: tuple[list, list, list, list], alternative: Alternative = alternative,
                 found: list[SubMatch] = found, offered: list[SubMatch] = offered) -> Any:
            found.append(sub := SubMatch(alternative, alternative_matcher(outer, alternative), state, choice.name))
            if maximal and id(sub.end) in inside_earlier:
                return None  # ends inside an earlier alternative's sub-match: not offered
            offered.append(sub)
            return take(sub)

        search = _search_alternative(outer, alternative, None, block, failures is not None, each,
                                     entry=(alternative.slots.index(slot), var))
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


def _search_alternative(
    outer: Any, alternative: Alternative, op: Operation | None, block: Any, trace: bool, take: Take,
    entry: tuple[int, Var] | None = None,
) -> Any:
    """The interpreter's search of the alternative, anchored at its last op bound to ``op`` or entered
    from ``entry`` (root index, variable), calling ``take`` with each complete match's search state (its
    truthy result ends the search, kept as ``.result``). The alternative's bind attempts go to ``outer``;
    those made while ``take`` runs are not its own (``take`` may search the same alternative again).
    (The generated search writes the alternatives' searches into its own: :mod:`~pattern_infra.codegen_choices`.)"""
    matcher = alternative_matcher(outer, alternative)
    plan = matcher.plans[alternative.compiled.final_nodes[0]] if entry is None else matcher.root_plans[entry[0]]
    search = _continuing(matcher)(matcher, block, plan, trace)
    before = matcher.bind_attempts

    def counted(state: tuple[list, list, list, list]) -> Any:
        nonlocal before
        outer.bind_attempts += matcher.bind_attempts - before
        try:
            return take(state)
        finally:
            before = matcher.bind_attempts

    search.take = counted
    try:
        if entry is None:
            search.run(op)
        else:
            search.run_entered(*entry)
    finally:
        outer.bind_attempts += matcher.bind_attempts - before
    return search


def taken_further(outer: Any, choice: Choice, alternative: Alternative, op: Operation, block: Any) -> bool:
    """Whether an alternative before ``alternative`` matches at an op below ``op`` with ``op`` inside."""
    for below in candidates_below(op.outputs[0], choice):
        for earlier in choice.alternatives[: alternative.index]:
            if below.op_type not in earlier.compiled.nodes[earlier.compiled.final_nodes[0]].op_types:
                continue
            states: list[tuple[list, list, list, list]] = []
            _search_alternative(outer, earlier, below, block, False, states.append)
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


_CONTINUING: dict[type, type] = {}


def _continuing(matcher: Any) -> type:
    """The matcher's interpreter search (``matcher.search_class``) that, at each complete match, calls
    ``take`` with a copy of its state and stops when that returns a truthy value (kept as ``result``);
    one subclass per search class, made on first use."""
    base = matcher.search_class
    cls = _CONTINUING.get(base)
    if cls is None:

        class Continuing(base):  # type: ignore[valid-type, misc]
            __slots__ = ("take",)

            def final_checks(self) -> bool:
                if not self.structure_ok():
                    return False
                self.result = self.take((list(self.ops), list(self.assign), list(self.roots), list(self.subs)))
                return bool(self.result)

        cls = _CONTINUING[base] = Continuing
    return cls


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
    the ``op_lists`` (:func:`subs_final_ok`, as the generated search calls it with its rows' fields)."""
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


def choice_types(choice: Choice) -> frozenset[str]:
    """Every op type a sub-match of ``choice`` may contain."""
    return frozenset().union(*(all_op_types(alternative.compiled) for alternative in choice.alternatives))


def has_fallback(compiled: CompiledPattern) -> bool:
    """Whether ``compiled`` has a ``fallback`` choice, at any depth of its alternatives."""
    return any(
        node.choice is not None
        and (node.choice.fallback or any(has_fallback(a.compiled) for a in node.choice.alternatives))
        for node in compiled.nodes
    )
