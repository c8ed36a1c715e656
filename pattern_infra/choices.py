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
found lazily). The generated search writes each alternative's search into its own
(:mod:`~pattern_infra.codegen_choices`). Cost per choice node: the sum of the alternatives' sizes, never
the product of the choices; a pass's search with the 12-spelling pattern below makes the bind attempts of
one spelling written out and 1.09x its instructions (``python -m bench.choices --instructions``). ``explain`` reports "tried 3 alternatives for 'normed': ..." with each
one's first failure.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coremltools.converters.mil.mil import Operation, Var
from coremltools.converters.mil.mil import block as _block

from .errors import PatternDefinitionError

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
