"""Alternatives at any point of a pattern: ``one_of`` and ``optional``.

A real model writes one computation several ways (``x * x`` or ``pow(x, 2)``; ``x * rsqrt(v)``,
``x / sqrt(v)`` or ``x * (1 / sqrt(v))``; a weight that may be absent). Instead of one pattern per
combination (the product of the spellings), a pattern declares, at the point where spellings differ, a
*choice* of small programs, in the ``mb.program`` style::

    def normed(x, v):
        return one_of("normed",
                      lambda: mb.mul(x=x, y=mb.rsqrt(x=v, name="inv"), name="scale"),
                      lambda: mb.real_div(x=x, y=mb.sqrt(x=v, name="root"), name="scale"),
                      lambda: mb.mul(x=x, y=mb.real_div(x=1.0, y=mb.sqrt(x=v, name="root"), name="inv"),
                                     name="scale"))

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), 8)), mb.TensorSpec(shape=(8,))])
    def rms_norm(x, w):
        sq = one_of("square", lambda: mb.mul(x=x, y=x, name="sq"),
                              lambda: mb.pow(x=x, y=2.0, name="sq"))
        v = mb.add(x=mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var")
        return optional("weighted", lambda: normed(x, v), lambda n: mb.mul(x=n, y=w, name="weight"))

One pattern, 2 x 3 x 2 = 12 spellings.

Rules (checked when the pattern is built or compiled, with the rule and the fix in the message):

* An alternative is a function of no arguments that builds ops and returns the variable the choice
  stands for, computed by one of *its own* ops (not an input, not a constant, not a variable built
  elsewhere).
* Alternatives read variables from outside (pattern inputs, earlier pattern ops, constants); an earlier
  pattern *op* read by one alternative must be read by every alternative (otherwise nothing would bind
  it when another alternative matched: move it into the alternatives that read it). A pattern input may
  be read by only some alternatives (``w`` above); when another matched, ``pattern.root_vars`` holds
  None for it.
* Names: unique within each alternative and distinct from the ops outside the choice; alternatives of one
  choice may reuse a name (only one of them is ever bound): ``pattern.scale`` is whichever matched.
  ``pattern.<choice name>`` is the op producing the choice's variable; ``pattern.choices`` maps each
  choice to the index of the alternative that matched; ops of the other alternatives are not attributes.
* Choices nest (a ``one_of`` inside an alternative). ``optional(name, base, extra)`` is
  ``one_of(name, lambda: extra(base()), base)``: ``base`` builds the ops the optional op applies to.

How it is compiled (no product of sub-passes): the ops of the choice become one pattern node, a *choice
node*, whose input slots are the variables its alternatives read from outside; each alternative is
compiled on its own into a small :class:`~pattern_infra.compiler.CompiledPattern` (its inputs are those
variables). The outer search binds a choice node like an op. Reached by an up-step (or as the anchor),
the program op producing the variable is offered to the alternatives whose last op has its type, each
searched anchored there (:func:`choice_matches`). Reached by a down-step from a variable bound in one of
its slots, each alternative is searched *entered from that variable* (:func:`entered_matches`): a
down-step to the op reading it, then the alternative's own plan, so only the ops below the variable an
alternative reaches are bound. Every complete sub-match gives values for the slots and the outer search
goes on with them; backtracking tries the next sub-match, then the next alternative (sub-matches are
found lazily). Cost per choice node: the sum of the alternatives' sizes, never the product of the
choices; a pattern with 12 spellings makes 1.33x the bind attempts of one spelling written out
(``python -m bench.choices``). ``explain`` reports "tried 3 alternatives for 'normed': ..." with each
one's first failure.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coremltools.converters.mil.mil import Operation, Var
from coremltools.converters.mil.mil import block as _block

from .binding import match_dicts
from .errors import PatternDefinitionError
from .plan import Failure, slot_value

if TYPE_CHECKING:
    from .compiler import CompiledPattern

__all__ = ["Alternative", "Choice", "one_of", "optional"]


@dataclass
class Record:
    """What :func:`one_of` saw while the pattern program was built."""

    name: str
    alternatives: list[tuple[list[Operation], Var]]
    """Per alternative: the ops it created (consts included, nested choices' ops included) and its output."""
    children: dict[int, list[Record]] = field(default_factory=dict)
    """Per alternative, the choices declared inside it (nested choices)."""
    fallback: bool = False
    """See :func:`one_of`."""


_RECORDS: weakref.WeakKeyDictionary[Any, list[Record]] = weakref.WeakKeyDictionary()
"""Pattern function (coremltools ``Function``) to the choices declared at its top level while it was
built (a pattern function is never changed once built, so the record stays true)."""

_ACTIVE: list[tuple[Record, int]] = []
"""The alternatives being built right now (innermost last)."""


@dataclass
class Alternative:
    """One alternative of a choice, compiled on its own."""

    index: int
    """Position among the choice's alternatives."""
    compiled: CompiledPattern
    """The alternative as a pattern: its inputs are the outside variables it reads."""
    slots: list[str]
    """For each input of ``compiled``, the choice node's slot it stands for."""
    label: str
    """The alternative in words, e.g. ``real_div(x, sqrt(var))``, for ``explain``."""


@dataclass
class Choice:
    """The alternatives of one choice node."""

    name: str
    """The choice's name (``pattern.<name>`` is the op producing its variable)."""
    alternatives: list[Alternative]
    """In the order they are tried."""
    depth: int
    """Most ops on a path through one alternative: how far below an input its output op may lie."""
    output_types: frozenset[str] = field(default_factory=frozenset)
    """Op types the choice's variable may be produced by."""
    full_slots: frozenset[str] = field(default_factory=frozenset)
    """Slots every alternative reads."""
    reads: dict[str, int] = field(default_factory=dict)
    """For a slot holding a pattern op's output: how many times each alternative reads it (the same in
    every alternative), for the outer check that the op's output has no consumer outside the match."""
    uses: dict[str, int] = field(default_factory=dict)
    """For every slot, how many times the first alternative reading it reads it."""

    fallback: bool = False
    """A later alternative is also offered inside an earlier one's match (see :func:`one_of`)."""
    entries: dict[str, list[frozenset[str]] | None] = field(default_factory=dict)
    """Per slot, the op types each alternative may be entered by from it, or None when a down-step
    through it cannot enter every alternative (:func:`enterable`)."""

    def reads_of(self, slot: str) -> int:
        """How many times an alternative reads ``slot`` (for a nested choice's input)."""
        return self.reads.get(slot, self.uses.get(slot, 1))


def one_of(name: str, *alternatives: Callable[[], Var], fallback: bool = False) -> Var:
    """Declares, inside an ``@mb.program`` pattern, a variable computed by one of several small programs.

    Alternatives are tried in the order written; write the longest first. When the choice ends the
    pattern (its variable may be used anywhere), a later alternative is by default never matched at an op
    inside a match of an earlier one (``norm * w`` is the weighted spelling, not the unweighted one
    followed by an unrelated ``mul``), whatever the constraints say of that match.

    Args:
        name: The choice's name: ``pattern.<name>`` is the op computing the variable in a match.
        *alternatives: Functions of no argument building ops with ``mb`` and returning the variable.
        fallback: Offer a later alternative inside an earlier one's match too, after it (when the choice
            is reached from one of its inputs, not as the anchor): what a pass written as one pattern
            per spelling, longest first, does when its constraints refuse the longer match (a weight the
            fusion cannot absorb stays an op after the fused one). ``find_matches`` then reports both.

    Returns:
        The first alternative's variable, for the rest of the pattern to use.

    Raises:
        PatternDefinitionError: Called outside a pattern program, fewer than two alternatives, or an
            alternative that does not return a variable computed by one of its own ops.
    """
    func = _block.curr_block() if _block.BLOCK_STACK else None
    if func is None:
        raise PatternDefinitionError(
            f"one_of({name!r}) must be called while an @mb.program pattern is built, inside the "
            f"decorated function."
        )
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise PatternDefinitionError(
            f"one_of: the choice name {name!r} must be a Python identifier not starting with '_' (it "
            f"is read as pattern.<name>)."
        )
    if len(alternatives) < 2 or not all(callable(a) for a in alternatives):
        raise PatternDefinitionError(
            f"one_of({name!r}) needs at least two alternatives, each a function of no argument building "
            f"ops (e.g. lambda: mb.mul(x=x, y=x, name='sq')); got {len(alternatives)}."
        )
    record = Record(name, [], fallback=fallback)
    if _ACTIVE:
        parent, k = _ACTIVE[-1]
        parent.children.setdefault(k, []).append(record)
    else:
        _RECORDS.setdefault(func, []).append(record)
    for k, build in enumerate(alternatives):
        start = len(func.operations)
        _ACTIVE.append((record, k))
        try:
            out = build()
        finally:
            _ACTIVE.pop()
        ops = list(func.operations)[start:]
        if not isinstance(out, Var) or out.op is None or all(out.op is not op for op in ops) or (
            out.op.op_type == "const"
        ):
            what = out.name if isinstance(out, Var) else type(out).__name__
            raise PatternDefinitionError(
                f"one_of({name!r}): alternative {k} returns {what}, which none of its own ops computes. "
                f"Rule: every alternative produces the choice's variable with one of the ops it builds. "
                f"Fix: return the output of the alternative's last op (e.g. lambda: mb.mul(x=x, y=x, "
                f"name='sq')), not a pattern input, a constant or a variable built outside it."
            )
        record.alternatives.append((ops, out))
    return record.alternatives[0][1]


def optional(name: str, base: Callable[[], Var], extra: Callable[[Var], Var], fallback: bool = False) -> Var:
    """Declares an op that may be absent: ``one_of(name, lambda: extra(base()), base, fallback=fallback)``.

    ``base`` builds the part of the pattern the optional op applies to (it is built once per
    alternative, so its ops may carry the same names in both; a ``one_of`` inside it becomes a nested
    choice). What is not supported: an alternative made of no op at all (an optional op whose input is a
    pattern input): a choice stands for the op computing its variable.

    Args:
        name: The choice's name.
        base: Builds the ops the optional op reads from, returning their variable.
        extra: Builds the optional op(s) on that variable.
        fallback: As for :func:`one_of`: without the optional op when the match with it is refused.

    Returns:
        The variable with ``extra`` applied (the first alternative).
    """
    return one_of(name, lambda: extra(base()), base, fallback=fallback)


# -- compiling: a choice becomes one node, each alternative a small pattern ---------------------------------


def records_of(func: Any) -> list[Record]:
    """The choices declared at the top level of a pattern function, in the order they were declared."""
    return list(_RECORDS.get(func, []))


class Region:
    """The ops of one alternative, read by the compiler as if they were a function."""

    def __init__(self, operations: list[Any], inputs: dict[str, Var], outputs: list[Var]) -> None:
        self.operations = operations
        self.inputs = inputs
        self.outputs = outputs


class _ChoiceOp:
    """Stands for a choice among the ops of its level while the compiler reads them (an op-like object)."""

    op_type = "one_of"
    blocks: tuple[()] = ()

    def __init__(self, name: str, inputs: dict[str, Var], output: Var, choice: Choice) -> None:
        self.name = name
        self.inputs = inputs
        self.outputs = [output]
        self.choice = choice


CompileRegion = Callable[[Region, str, list[Record]], "CompiledPattern"]
"""``compile(region, name, choices inside it)``: the compiler, for one alternative."""


def collapse(
    ops: list[Any], records: list[Record], pattern_name: str, compile_region: CompileRegion
) -> list[Any]:
    """Replaces the ops of each choice of ``records`` in ``ops`` by one :class:`_ChoiceOp`, compiling
    each alternative with ``compile_region``.

    Raises:
        PatternDefinitionError: A rule of the module docstring is broken.
    """
    result = list(ops)
    for record in records:
        region = {id(op) for alt_ops, _ in record.alternatives for op in alt_ops}
        first = next((i for i, op in enumerate(result) if id(op) in region), None)
        if first is None:
            continue
        outside = [op for op in result if id(op) not in region]
        _check_outside_reads(record, outside, region, pattern_name)
        choice, inputs = _choice_of(record, outside, pattern_name, compile_region)
        stand_in = _ChoiceOp(record.name, inputs, record.alternatives[0][1], choice)
        result = result[:first] + [stand_in] + [op for op in result[first:] if id(op) not in region]
    return result


def _vars_read(op: Any) -> list[Var]:
    out: list[Var] = []
    for value in op.inputs.values():
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    return out


def _check_outside_reads(record: Record, outside: list[Any], region: set[int], pattern_name: str) -> None:
    kept = record.alternatives[0][1]
    for op in outside:
        for var in _vars_read(op):
            if var is not kept and var.op is not None and id(var.op) in region:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: op {op.name!r} reads {var.name!r}, built inside choice "
                    f"{record.name!r}. Only the choice's own variable (what one_of returns) may be used "
                    f"outside it; build the rest inside every alternative."
                )


def _choice_of(
    record: Record, outside: list[Any], pattern_name: str, compile_region: CompileRegion
) -> tuple[Choice, dict[str, Var]]:
    outside_names = {op.name for op in outside if op.op_type != "const"}
    alt_region = [{id(op) for op in alt_ops} for alt_ops, _ in record.alternatives]
    external: list[list[Var]] = []
    for k, (alt_ops, out) in enumerate(record.alternatives):
        reads: dict[int, Var] = {}
        for op in alt_ops:
            if op.op_type != "const" and op.name in outside_names:
                raise PatternDefinitionError(
                    f"Pattern {pattern_name!r}: op name {op.name!r} in alternative {k} of choice "
                    f"{record.name!r} is also used outside the choice. Alternatives of one choice may "
                    f"share names; rename it so it differs from the ops outside."
                )
            for var in _vars_read(op):
                if var.op is not None and id(var.op) in alt_region[k]:
                    continue
                other = next((j for j, ids in enumerate(alt_region) if var.op is not None and id(var.op) in ids), None)
                if other is not None:
                    raise PatternDefinitionError(
                        f"Pattern {pattern_name!r}: alternative {k} of choice {record.name!r} reads "
                        f"{var.name!r}, built by alternative {other}. Alternatives are independent: "
                        f"build it again inside alternative {k}."
                    )
                reads.setdefault(id(var), var)
        external.append(list(reads.values()))
    slots: dict[int, str] = {}
    inputs: dict[str, Var] = {}
    for reads in external:
        for var in reads:
            if id(var) not in slots:
                slot = var.name if var.name.isidentifier() and var.name not in inputs else f"in{len(inputs)}"
                slots[id(var)] = slot
                inputs[slot] = var
    for var in inputs.values():
        is_op = var.op is not None and var.op.op_type != "const"
        missing = [k for k, reads in enumerate(external) if all(v is not var for v in reads)]
        if is_op and missing:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: op {var.op.name!r} is read by some alternatives of choice "
                f"{record.name!r} but not by alternative(s) {missing}, so nothing would match it when "
                f"those do. Build it inside the alternatives that read it."
            )

    alternatives = []
    for k, (alt_ops, out) in enumerate(record.alternatives):
        region_inputs = {slots[id(v)]: v for v in external[k]}
        compiled = compile_region(
            Region(list(alt_ops), region_inputs, [out]), f"{pattern_name}.{record.name}[{k}]",
            record.children.get(k, []),
        )
        alternatives.append(Alternative(k, compiled, list(region_inputs), _label(compiled)))
    reads: dict[str, int] = {}
    for slot, var in inputs.items():
        if var.op is None or var.op.op_type == "const":
            continue
        per_alt = [_uses(a.compiled, a.slots.index(slot)) for a in alternatives]
        if len(set(per_alt)) > 1:
            raise PatternDefinitionError(
                f"Pattern {pattern_name!r}: the alternatives of choice {record.name!r} read {var.name!r} a "
                f"different number of times ({per_alt}), so whether it has a consumer outside the match "
                f"would depend on the alternative. Read it the same number of times in each (e.g. through "
                f"one op)."
            )
        reads[slot] = per_alt[0]
    full = frozenset(s for s in inputs if all(any(slots[id(v)] == s for v in reads) for reads in external))
    choice = Choice(
        name=record.name,
        alternatives=alternatives,
        fallback=record.fallback,
        depth=max(_depth(a.compiled) for a in alternatives),
        output_types=frozenset(t for a in alternatives for n in a.compiled.final_nodes
                               for t in a.compiled.nodes[n].op_types),
        full_slots=full,
        reads=reads,
        uses={slot: next(_uses(a.compiled, a.slots.index(slot)) for a in alternatives if slot in a.slots)
              for slot in inputs},
    )
    return choice, inputs


def _uses(compiled: CompiledPattern, root: int) -> int:
    """How many times a match of ``compiled`` reads its input ``root`` (nested choices counted as their
    alternatives read)."""
    total = 0
    for n, slot, _ in compiled.root_consumers[root]:
        choice = compiled.nodes[n].choice
        total += choice.reads_of(slot) if choice is not None else 1
    return total


def _depth(compiled: CompiledPattern) -> int:
    depth: list[int] = []
    for node in compiled.nodes:
        own = node.choice.depth if node.choice is not None else 1
        preds = [depth[e.index] for _, edge in node.inputs.items()
                 for e in (edge if isinstance(edge, tuple) else (edge,)) if e.kind == "op"]
        depth.append(own + max(preds, default=0))
    return max(depth)


def _label(compiled: CompiledPattern) -> str:
    """The alternative as an expression of its output, e.g. ``mul(x, rsqrt(var))``."""

    def text(index: int, budget: list[int]) -> str:
        node = compiled.nodes[index]
        budget[0] -= 1
        if budget[0] < 0:
            return "..."
        args = []
        for slot, edge in node.inputs.items():
            for e in edge if isinstance(edge, tuple) else (edge,):
                if e.kind == "root":
                    args.append(compiled.root_names[e.index])
                elif e.kind == "op":
                    args.append(text(e.index, budget))
                elif slot in ("x", "y"):  # an operand; other constants are attributes (axes, epsilon)
                    value = compiled.consts[e.index][1]
                    if value is not None and value.size == 1 and value.dtype.kind in "biuf":
                        args.append(f"{value.reshape(()).item():g}")
        kind = node.choice.name if node.choice is not None else node.op_type
        return f"{kind}({', '.join(args)})"

    return text(compiled.final_nodes[0], [12])


# -- matching: the helper both searches (interpreter and compiled) call for a choice node -------------------


class SubMatch:
    """One complete match of one alternative, ending at the op computing the choice's variable.

    Kept as the search's state (a few list copies); the alternative's ops, operands and constants are
    written into dicts only when a whole match is built (:meth:`parts`).
    """

    __slots__ = ("alternative", "slots", "ops", "end", "choice", "_matcher", "_state", "_parts")

    def __init__(self, alternative: Alternative, matcher: Any, state: tuple[list, list, list, list],
                 choice: str) -> None:
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
        self._matcher = matcher
        self._state = state
        self._parts: Any = None

    def parts(self) -> tuple[dict[str, Operation], dict[str, dict[str, Any]], dict[str, Var], dict[str, int]]:
        """The alternative's ops, operands and constants by name, and its nested choices, as a Pattern
        of it would hold them (``binding.match_dicts``), built on first use."""
        if self._parts is None:
            ops, assign, _, subs = self._state
            self._parts = match_dicts(self._matcher, ops, assign, subs)
        return self._parts

    def const_vars(self) -> list[Var]:
        """The program variables in the alternative's constant slots (nested choices' included)."""
        ops, assign, roots, subs = self._state
        out = [v for n, slot, pos in self._matcher.const_slots
               if (v := slot_value(assign, n, slot, pos)) is not None]
        for sub in subs:
            if sub is not None:
                out.extend(sub.const_vars())
        return out


def alternative_matcher(outer: Any, alternative: Alternative) -> Any:
    """The alternative's matcher, built on first use as one of the outer matcher's class (this module
    does not import the matcher, which imports it)."""
    matcher = getattr(alternative, "_matcher", None)
    if matcher is None:
        matcher = type(outer)(alternative.compiled)
        alternative._matcher = matcher  # type: ignore[attr-defined]
    return matcher


def choice_matches(
    outer: Any, choice: Choice, op: Operation, block: Any, failures: list[str] | None = None,
    maximal: bool = False,
) -> Iterator[SubMatch]:
    """Every complete match of every alternative of ``choice`` whose last op is ``op``, in order, found
    lazily (a search that takes the first one never searches the later alternatives).

    Only the alternatives whose last op accepts ``op``'s type are searched (a dispatch on the op type:
    the others could not bind it). Each is searched anchored at its last op, collecting all its complete
    matches (a commutative op may give two); the bind attempts it makes are added to
    ``outer.bind_attempts``, less the anchor, which the outer search bound and counted already, so the
    interpreter and the compiled search count the same.

    Args:
        outer: The matcher of the pattern holding the choice node.
        choice: The choice.
        op: The program op offered as the alternatives' last op.
        block: The block searched.
        failures: If given, receives for each alternative without a match ``"<label>: <reason>"`` (the
            alternatives are then searched with tracing, as ``explain`` does).
        maximal: The choice ends the pattern (its variable may be used anywhere): a later alternative is
            left out at ``op`` when an earlier one matches further down with ``op`` inside (the longest
            spelling wins, as with ``optional``: ``norm * w`` is not matched as ``norm`` followed by an
            unrelated ``mul``).

    Yields:
        The sub-matches, alternative by alternative.
    """
    failure_type = Failure
    op_type = op.op_type
    for alternative in choice.alternatives:
        end = alternative.compiled.nodes[alternative.compiled.final_nodes[0]]
        if op_type not in end.op_types:
            if failures is not None:
                failures.append(f"{alternative.label}: ends with {end.op_type_label}, not {op_type}")
            continue
        search = _search_alternative(outer, alternative, op, block, failures is not None)
        outer.bind_attempts -= 1  # the anchor: bound (and counted) by the outer search
        if search.found and maximal and alternative.index > 0 and _taken_further(outer, choice, alternative,
                                                                                  op, block):
            if failures is not None:
                failures.append(f"{alternative.label}: an earlier alternative matches further down")
            continue
        if not search.found and failures is not None:
            failure = search.failure
            reason = failure.reason if isinstance(failure, failure_type) else "no match"
            failures.append(f"{alternative.label}: {reason}")
        matcher = alternative_matcher(outer, alternative)
        for state in search.found:
            yield SubMatch(alternative, matcher, state, choice.name)


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
    outer: Any, choice: Choice, slot: str, var: Var, block: Any, failures: list[str] | None = None,
    maximal: bool = False,
) -> Iterator[SubMatch]:
    """Every complete match of every alternative of ``choice`` reading ``var`` in ``slot``, found lazily
    by a search of each alternative *entered* from ``var`` (``Matcher.root_plans``): a down-step into a
    choice binds only the ops below ``var`` that an alternative reaches, each once per alternative, where
    offering every op within the choice's depth to every alternative (:func:`candidates_below`) searched
    again what the alternatives share. :func:`enterable` says when this applies.

    Args:
        outer: The matcher of the pattern holding the choice node (its ``bind_attempts`` receive the
            alternatives' binds).
        choice: The choice.
        slot: The choice node's slot the down-step goes through (every alternative reads it).
        var: The program variable bound to ``slot``.
        block: The block searched.
        failures: As for :func:`choice_matches`.
        maximal: The choice ends the pattern: a match of a later alternative is left out when its last
            op lies inside a match of an earlier alternative found here, ending further down (the longest
            spelling wins, as in :func:`choice_matches`).

    Yields:
        The sub-matches, alternative by alternative; ``sub.end`` is the op the choice node binds.
    """
    failure_type = Failure
    maximal = maximal and not choice.fallback
    inside_earlier: set[int] = set()
    entry_types = _entry_types(choice, slot)
    below = {op.op_type for op in var.child_ops}
    for alternative, types in zip(choice.alternatives, entry_types):  # type: ignore[arg-type]
        if below.isdisjoint(types):  # a dispatch on the consumers' types: nothing to enter by
            if failures is not None:
                failures.append(f"{alternative.label}: no consumer of {var.name} is {' or '.join(sorted(types))}")
            continue
        search = _search_alternative(outer, alternative, None, block, failures is not None,
                                     entry=(alternative.slots.index(slot), var))
        matcher = alternative_matcher(outer, alternative)
        subs = [SubMatch(alternative, matcher, state, choice.name) for state in search.found]
        kept = [sub for sub in subs if id(sub.end) not in inside_earlier] if inside_earlier else subs
        if maximal:
            inside_earlier.update(id(o) for sub in subs for o in sub.ops if o is not sub.end)
        if failures is not None:
            if subs and not kept:
                failures.append(f"{alternative.label}: an earlier alternative matches further down")
            elif not subs:
                failure = search.failure
                reason = failure.reason if isinstance(failure, failure_type) else "no match"
                failures.append(f"{alternative.label}: {reason}")
        yield from kept


class _Collected:
    """What the generated collecting search found (no failure: it never traces)."""

    __slots__ = ("found", "failure")

    def __init__(self, found: list[Any]) -> None:
        self.found = found
        self.failure = None


def _search_alternative(
    outer: Any, alternative: Alternative, op: Operation | None, block: Any, trace: bool,
    entry: tuple[int, Var] | None = None,
) -> Any:
    """The alternative's search run to the end (``.found``: every match, as search state), anchored at
    its last op bound to ``op``, or entered from ``entry`` (root index, variable): the generated
    collecting search, or the interpreter when tracing (or forced)."""
    matcher = alternative_matcher(outer, alternative)
    anchor = alternative.compiled.final_nodes[0]
    root = None if entry is None else entry[0]
    before = matcher.bind_attempts
    fn = None if trace else matcher.collector(anchor, root)
    if fn is not None:
        found = fn(matcher, op if entry is None else entry[1], block)
        outer.bind_attempts += matcher.bind_attempts - before
        return _Collected(found)
    if entry is None:
        search = collecting_search(matcher)(matcher, block, matcher.plans[anchor], trace)
        search.found = []
        search.run(op)
    else:
        search = collecting_search(matcher)(matcher, block, matcher.root_plans[entry[0]], trace)
        search.found = []
        search.run_entered(*entry)
    outer.bind_attempts += matcher.bind_attempts - before
    return search


def _taken_further(outer: Any, choice: Choice, alternative: Alternative, op: Operation, block: Any) -> bool:
    """Whether an alternative before ``alternative`` matches at an op below ``op`` with ``op`` inside."""
    for below in candidates_below(op.outputs[0], choice):
        for earlier in choice.alternatives[: alternative.index]:
            if below.op_type not in earlier.compiled.nodes[earlier.compiled.final_nodes[0]].op_types:
                continue
            for state in _search_alternative(outer, earlier, below, block, False).found:
                if any(o is op for o in state[0]) or any(
                        sub is not None and any(o is op for o in sub.ops) for sub in state[3]):
                    return True
    return False


_COLLECTING: dict[type, type] = {}


def collecting_search(matcher: Any) -> type:
    """The matcher's interpreter search (``matcher.search_class``), collecting every complete match
    instead of stopping at the first; one subclass per search class, made on first use."""
    base = matcher.search_class
    cls = _COLLECTING.get(base)
    if cls is None:

        class Collecting(base):  # type: ignore[valid-type, misc]
            __slots__ = ("found",)

            def final_checks(self) -> bool:
                if self.structure_ok():
                    self.found.append((list(self.ops), list(self.assign), list(self.roots), list(self.subs)))
                return False

        cls = _COLLECTING[base] = Collecting
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


def clashes(sub: SubMatch, bound: Sequence[Any], bound_subs: Sequence[SubMatch] = ()) -> bool:
    """Whether an op of ``sub`` is already bound by the outer search (a match is injective): one of the
    ``bound`` program ops or of the sub-matches of choices bound before (the generated search's check;
    the interpreter reads its ``used`` map, which holds the same ops)."""
    ids = {id(op) for op in bound if op is not None}
    for other in bound_subs:
        ids.update(id(op) for op in other.ops)
    return any(id(op) in ids for op in sub.ops)


def op_in_subs(op: Operation, subs: Sequence[SubMatch | None]) -> bool:
    """Whether ``op`` is an op of one of the sub-matches."""
    return any(sub is not None and any(op is o for o in sub.ops) for sub in subs)


def computed_inside(var: Var | None, ops: Sequence[Any], subs: Sequence[SubMatch | None]) -> bool:
    """Whether ``var`` is computed by an op of the match: ``ops`` (the outer ops) or a sub-match."""
    producer = var.op if var is not None else None
    if producer is None:
        return False
    if any(producer is op for op in ops):
        return True
    return any(sub is not None and any(producer is op for op in sub.ops) for sub in subs)


def subs_final_ok(ops: Sequence[Any], subs: Sequence[SubMatch | None]) -> bool:
    """The outer final check the alternatives cannot make themselves: no constant slot of a sub-match is
    computed by an op of the match (the outer ops or another sub-match; one computed by an op of its own
    sub-match was refused by that sub-match's search already)."""
    producers = [p for sub in subs if sub is not None for var in sub.const_vars() if (p := var.op) is not None]
    if not producers:
        return True
    inside = {id(op) for op in ops if op is not None}
    for sub in subs:
        if sub is not None:
            inside.update(id(op) for op in sub.ops)
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
