"""Compile a matcher's search plan into one specialised Python function per anchor.

:class:`~pattern_infra.matcher.Matcher` searches a pattern with an interpreter (``interpreter.Search``): one generic
``bind`` per op, a generator of operand orders, a loop over edges, a dict per assignment. Most of its time
goes to Python calls and allocations, not to the checks themselves. For a (matcher, anchor) pair the plan
is fixed, so the search can be written out once as straight-line code that does exactly the same checks in
the same order of choices, and ``exec``'d. ``Matcher.match_at`` builds that function lazily, the first time
an anchor is used, and calls it whenever it neither traces nor has a root hint.

How the source of one search is generated (:func:`generate`):

1. **Locals instead of state.** The program op bound to pattern op ``n`` is the local ``o<n>``, its
   operands ``v<n>_<slot>`` (as assigned, after any ``x``/``y`` swap) and root ``k`` is ``r<k>``. Nothing
   is saved or restored on backtracking: a local is reassigned whenever its choice point is re-entered.
2. **Choice points are ``for`` loops.** A commutative op whose program op may be swapped loops over its
   one or two operand orders (in the interpreter's order: as written first, unless the swapped order puts
   more compile-time constants where the pattern has its constants; one order when ``x is y``); a
   down-step loops over the distinct consumers of a variable. Everything the plan does after a choice is
   nested inside its loop, so chronological backtracking is a plain ``continue`` of the innermost loop,
   and a failure outside any loop returns None.
3. **One binding = a run of guards**, cheapest first: op type (a single type compares a string), number
   of outputs, block, not already bound (compared only with earlier ops whose accepted types overlap);
   operands fetched from ``op._input_vars`` (missing or internal means failure, except a wildcard constant
   slot that an alternative op type lacks, which is skipped); then the data edges whose both ends are
   bound: consumers and producers the very same variables, tuple slots (a list in coremltools' op, such
   as ``concat``'s ``values``, or a tuple) of the right length. Roots are
   static: the first pattern edge reaching root ``k`` in plan order assigns ``r<k>``, every later one
   compares with it. Constant rules are checked last, reading ``var._sym_val.val`` directly when it is a
   plain number or a non-object array (``var.val`` would return it unchanged, after a costly symbol
   search); a ``"value"`` rule against a numeric scalar is inlined for float values with the tolerance
   ``atol + rtol * |expected|`` precomputed; anything else calls ``var.val`` and
   :meth:`~pattern_infra.compiler.ConstRule.accepts`.
4. **Final checks** sit in the innermost loop body, after the last binding, as in the interpreter: the
   outputs of non-final ops have exactly the pattern's uses and are not block outputs, and no root and no
   constant slot is computed by a matched op.
5. **Success** builds the :class:`~pattern_infra.pattern.Pattern` with ``Pattern._of_search`` from
   dicts written out as literals, equal to ``binding.build_pattern``'s. It is returned when there is no
   ``accept`` or ``accept`` returns ``True``; otherwise the innermost loop goes on to the next match.
   ``Matcher.bind_attempts`` is counted in a local and added once, in a ``finally``, by the interpreter's
   rule: the anchor, every producer reached by an up-step, every consumer of the right type not bound.
6. **Choice nodes** (``one_of``, ``optional``, ``equivalences=``): each alternative's search is written
   into this one (:mod:`~pattern_infra.codegen_choices`); the rest of the search after the choice is a
   function it calls with each sub-match it finds, or, when small, written where it finds one
   (:mod:`~pattern_infra.codegen_rests`).
7. **Compilation** registers the source with :mod:`linecache` under the file name
   ``<pattern_infra.codegen:{pattern}:{anchor}>`` (tracebacks show the generated lines) and keeps it on
   the function as ``__source__``; ``Matcher.source(anchor)`` returns it.

Not compiled (the matcher keeps the interpreter for that pattern, or that anchor): patterns with a fan-out
op (``fanout=``); a commutative op whose ``x`` or ``y`` is a wildcard constant an alternative op type may
lack; plans with more nested choice points than CPython compiles (its limit of 20 statically nested
blocks per function, the ``try`` included, so 19 loops; the rest after a choice is a function of its own,
and is written into its call sites only when the result still compiles).

One deliberate difference: a list or tuple in ``x`` or ``y`` of a commutative op (which MIL's binary ops
cannot hold) makes the interpreter raise ``AttributeError``; the compiled search rejects that binding.

Debugging: with ``PATTERN_INFRA_INTERPRET=1`` in the environment (read at every ``match_at``, through
``os.environ``'s own mapping: one dict lookup), every search runs in the interpreter.
"""

from __future__ import annotations

import linecache
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.var import InternalVar

from . import choice_search
from .binding import build_pattern, pattern_of
from .compiler import Edge, PatternNode, edge_positions
from .pattern import Pattern
from .codegen_choices import ChoiceWriter
from .codegen_rests import RestWriter, resolve_rests
from .codegen_checks import (
    FLOAT_TYPES,
    PLAIN_VALUES,
    CheckWriter,
    NotCompilable,
    set_literal,
)
from .plan import DOWN, Step, optional_const

if TYPE_CHECKING:
    from .matcher import Matcher

__all__ = [
    "INTERPRET_ENV_VAR",
    "CompiledSearch",
    "GeneratedSearch",
    "build",
    "generate",
    "interpret_forced",
]

logger = logging.getLogger(__name__)

INTERPRET_ENV_VAR = "PATTERN_INFRA_INTERPRET"
"""Environment variable: ``1`` makes every ``Matcher.match_at`` use the interpreter."""

_ENV_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
try:
    _ENV_KEY: Any = os.environ.encodekey(INTERPRET_ENV_VAR)  # type: ignore[attr-defined]
    _ENV_ONE: Any = os.environ.encodevalue("1")  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - an os.environ without the CPython internals
    _ENV_DATA = None


def interpret_forced() -> bool:
    """Whether ``PATTERN_INFRA_INTERPRET=1`` is set right now.

    ``os.environ.get`` encodes its key on every call (about a microsecond, as much as a compiled search);
    this reads the mapping ``os.environ`` keeps its (encoded) items in, which ``os.environ`` updates on
    every assignment and deletion.
    """
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_ENV_KEY) == _ENV_ONE
    return os.environ.get(INTERPRET_ENV_VAR) == "1"  # pragma: no cover


CompiledSearch = Callable[
    ["Matcher", Operation, Block, "Callable[[list[Operation]], list[Operation]] | None", Any], "Pattern | None"
]
"""``fn(matcher, op, block, order, accept)``: the compiled ``Search.run`` for one anchor. The
matcher is an argument (not a global of the function), so a copy of a matcher counts its own attempts."""

_OP_TYPE_NAMES: dict[type, str] = {}
"""Program op class to its ``op_type``: ``Operation.op_type`` is a property of the class
(``type(self).__name__``), one Python call per read; a dict lookup is a quarter of it."""


def _learn_op_type(op: Operation) -> str:
    """Reads ``op.op_type`` and caches it for ``op``'s class."""
    name = op.op_type
    _OP_TYPE_NAMES[type(op)] = name
    return name


@dataclass
class GeneratedSearch:
    """The generated search of one anchor, compiled or not."""

    source: str
    """The Python source; when it is not compiled, it starts with a comment saying why (and is only that
    comment when the generator leaves the pattern to the interpreter)."""
    filename: str
    """The file name the source was compiled under (and registered with :mod:`linecache`)."""
    function: CompiledSearch | None
    """The compiled search, or None when the interpreter must be used."""
    reason: str = ""
    """Why there is no function."""


def _filename(matcher: Matcher, anchor: int | str, source: str) -> str:
    """``<pattern_infra.codegen:{pattern}:{anchor}>``, numbered (``...:{anchor}#2>``) when another pattern
    of the same name already registered different lines under it."""
    base = f"<pattern_infra.codegen:{matcher.compiled.name}:{anchor}"
    filename, k = base + ">", 1
    while len(linecache.cache.get(filename, ())) == 4 and "".join(linecache.cache[filename][2]) != source:
        k += 1
        filename = f"{base}#{k}>"
    return filename


def build(matcher: Matcher, anchor: int) -> GeneratedSearch:
    """Generates and compiles the search of ``matcher`` anchored at pattern op ``anchor``.

    Args:
        matcher: The matcher (its plans, pattern and counters are used by the function).
        anchor: Index of the anchor pattern op.

    Returns:
        The generated search; its ``function`` is None when the pattern needs the interpreter.
    """
    for inline in (True, False):  # rest functions written into their call sites, unless that nests too deep
        try:
            source, namespace = generate(matcher, anchor, inline)
        except NotCompilable as exc:
            text = _not_compiled(matcher, anchor, str(exc))
            return GeneratedSearch(text, _filename(matcher, anchor, text), None, str(exc))
        filename = _filename(matcher, anchor, source)
        try:
            code = compile(source, filename, "exec")
            break
        except SyntaxError as exc:  # too many statically nested blocks: more choice points than CPython allows
            if inline:
                continue
            reason = f"does not compile: {exc.msg}"
            logger.debug("%s anchor %d left to the interpreter: %s", matcher.compiled.name, anchor, reason)
            return GeneratedSearch(_not_compiled(matcher, anchor, reason) + source, filename, None, reason)
    exec(code, namespace)  # noqa: S102 - our own generated source
    function = namespace["search"]
    function.__source__ = source
    function.__qualname__ = function.__name__ = f"search_{_identifier(matcher.compiled.name)}_{anchor}"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return GeneratedSearch(source, filename, function)


def _not_compiled(matcher: Matcher, anchor: int, reason: str) -> str:
    name = matcher.compiled.name
    return f"# {name}, anchor {anchor}: not compiled ({reason}); the interpreter searches it\n"


def _identifier(text: str) -> str:
    return re.sub(r"\W", "_", text)


def generate(matcher: Matcher, anchor: int, inline: bool = True) -> tuple[str, dict[str, Any]]:
    """The source of the search anchored at ``anchor`` and the globals it runs with; ``inline``: small
    rest functions written into their call sites (:func:`~pattern_infra.codegen_rests.resolve_rests`).

    Raises:
        NotCompilable: The pattern has a feature left to the interpreter (see the module docstring).
    """
    return _Generator(matcher, anchor).run(inline)


class _Generator(CheckWriter, ChoiceWriter, RestWriter):
    """Writes the search of one anchor, step by step of its plan."""

    def __init__(self, matcher: Matcher, anchor: int, collect: bool = False, root: int | None = None,
                 namespace: dict[str, Any] | None = None) -> None:
        self.collect = collect
        """Collect every structural match into ``found`` (an alternative's search, written into the
        search holding its choice: :mod:`~pattern_infra.codegen_choices`) instead of returning the first."""
        self.m = matcher
        self.compiled = matcher.compiled
        self.nodes: list[PatternNode] = matcher.nodes
        self.root = root
        """An alternative's search entered from this root (``Matcher.root_plans``), or None: anchored at an op."""
        self.plan = matcher.plans[anchor] if root is None else matcher.root_plans[root]
        self.anchor = self.plan[0].node
        self.lines: list[str] = []
        self.depth = 1  # indentation, in levels of four spaces
        self.loops = 0  # enclosing for loops
        self.bound: list[int] = []  # pattern ops bound so far, in plan order
        self.init_choice_state()
        self.namespace: dict[str, Any] = namespace if namespace is not None else {
            "_InternalVar": InternalVar,
            "_Var": Var,
            "_NOT_A_VALUE": (InternalVar, list, tuple),
            "_SEQ": (list, tuple),
            "_ndarray": np.ndarray,
            "PLAIN_VALUES": PLAIN_VALUES,
            "FLOAT_TYPES": FLOAT_TYPES,
            "_tn": _OP_TYPE_NAMES.get,
            "_learn_op_type": _learn_op_type,
            "_of_search": Pattern._of_search,
            "_build_pattern": build_pattern,
            "_pattern_of": pattern_of,
            "_choice_matches": choice_search.choice_matches,
            "_entered": choice_search.entered_matches,
            "_each_row": choice_search.each_row,
            "_below": choice_search.candidates_below,
            "_consts_outside": choice_search.consts_outside,
            "_SM": choice_search.SubMatch,
            "_SMB": choice_search.SubMatch.built,
            "_present": choice_search.present_slots,
            "_Taken": choice_search.TakenFurther,
            "_ONCE": (None,),
            "_FINALS": self.compiled.final_names,
            "__name__": __name__,
        }
        self.slot_names: list[dict[str, str]] = [self._slot_names(node) for node in self.nodes]
        self.skippable: list[set[str]] = [
            {
                slot
                for slot, edge in node.inputs.items()
                if optional_const(self.compiled, edge) and len(node.op_types) > 1
            }
            for node in self.nodes
        ]

    # -- text ---------------------------------------------------------------------------------------

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def comment(self, text: str) -> None:
        self.line("# " + text)

    def fail_lines(self) -> list[str]:
        return ["continue"] if self.loops else ["return None"]

    def guard(self, condition: str, why: str = "") -> None:
        """``if condition: <backtrack>``."""
        self.line(f"if {condition}:" + (f"  # {why}" if why else ""))
        self.depth += 1
        for text in self.fail_lines():
            self.line(text)
        self.depth -= 1

    def constant(self, prefix: str, value: Any) -> str:
        name = f"_{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    # -- names --------------------------------------------------------------------------------------

    @staticmethod
    def _slot_names(node: PatternNode) -> dict[str, str]:
        """``v<n>_<slot>``, or ``v<n>_<k>`` for every slot if a slot name is no identifier."""
        n = node.index
        names = {slot: f"v{n}_{slot}" for slot in node.inputs}
        if all(slot.isidentifier() for slot in node.inputs):
            return names
        return {slot: f"v{n}_{k}" for k, slot in enumerate(node.inputs)}

    def value(self, n: int, slot: str, pos: int = -1) -> str:
        """Expression of the program variable in pattern slot ``slot`` (element ``pos``) of op ``n``."""
        name = self.slot_names[n][slot]
        return f"{name}[{pos}]" if pos >= 0 else name

    def raw(self, n: int, slot: str) -> str:
        """The operand as the program op has it, before an x/y swap."""
        return "a" + self.slot_names[n][slot][1:]

    def op_type(self, op: str) -> str:
        return f"(_tn(type({op})) or _learn_op_type({op}))"

    def type_mismatch(self, op: str, node: PatternNode) -> str:
        """The condition that ``op`` has none of ``node``'s types; for a choice node, it keeps the type
        in ``_t<n>`` for the dispatch on it (:meth:`~pattern_infra.codegen_choices.ChoiceWriter.inline_alternatives`)."""
        read = self.op_type(op)
        if node.choice is not None and op == f"o{node.index}":
            read = f"(_t{node.index} := {read})"
            self.typed.add(node.index)
        if len(node.op_types) == 1:  # a choice node's op_type is "one_of"; its op_types are its outputs'
            return f"{read} != {next(iter(node.op_types))!r}"
        return f"{read} not in {set_literal(node.op_types)}"

    def label(self, n: int) -> str:
        node = self.nodes[n]
        return f"{node.name!r} ({node.op_type_label})"

    # -- the function -------------------------------------------------------------------------------

    def run(self, inline: bool = True) -> tuple[str, dict[str, Any]]:
        self.prepare()
        compiled = self.compiled
        header = [
            f"# Generated by pattern_infra.codegen: the search of pattern {compiled.name!r} anchored at",
            f"# {self.label(self.anchor)}. Locals: o<n> the op bound to pattern op n, v<n>_<slot> its",
            "# operands (after any x/y swap), r<k> root k; nb counts bind attempts as the interpreter does.",
            "# A failed check `continue`s the innermost choice point (operand order or consumer).",
            "# (_tn(type(op)) or _learn_op_type(op)) is op.op_type, cached per op class.",
            "#",
        ]
        for n, node in enumerate(self.nodes):
            header.append(f"#   o{n} = {node.name}: {node.op_type_label}")
        for k, name in enumerate(compiled.root_names):
            header.append(f"#   r{k} = root {name!r}")
        header.append("")
        self.depth = 0
        self.line("def search(_m, op, block, order, accept):")
        self.depth = 1
        self.line("nb = 1")
        self.line("try:")
        self.depth = 2
        self.line(f"o{self.anchor} = op")
        self.steps()
        self.depth = 2
        self.loops = 0
        self.line("return None")
        self.depth = 1
        self.line("finally:  # every exit, an exception included, counts the bind attempts made")
        self.line("    _m.bind_attempts += nb")
        rests = resolve_rests(self.functions, self.lines, self.namespace, inline)
        return "\n".join(header + rests + self.lines) + "\n", self.namespace

    def steps(self) -> None:
        """The plan's steps from the bound anchor op ``o<anchor>`` (or entry root ``r<root>``), the final
        checks and what a match does (returned, or collected)."""
        a = self.anchor
        if self.root is None:
            self.comment(f"step 0: anchor {self.label(a)}")
            if self.anchor_placed:
                self.comment("(type, outputs and block checked by the enclosing search)")
            self.bind(a, via=None, filtered=self.anchor_placed, placed=self.anchor_placed)
        for i, st in enumerate(self.plan[1:] if self.root is None else self.plan, start=1 if self.root is None else 0):
            if st.kind == DOWN:
                self.down_step(i, st)
            else:
                self.up_step(i, st)
        self.final_checks()
        if self.collect:
            self.collected()
        else:
            self.success()
        self.close_rests()

    def prepare(self) -> None:
        """Refuses what the generator leaves to the interpreter (:class:`NotCompilable`) and notes the
        choice nodes, the roots read by some alternatives only and each root's first edge."""
        if any(node.fanout for node in self.nodes):
            raise NotCompilable("the pattern has a fan-out op")
        self.choice_nodes = [node.index for node in self.nodes if node.choice is not None]
        self.optional_roots: set[int] = set()
        for n in self.choice_nodes:
            node = self.nodes[n]
            for slot, edge in node.inputs.items():
                if slot in node.choice.full_slots:
                    continue
                if not isinstance(edge, Edge) or edge.kind != "root":
                    raise NotCompilable(f"choice {node.name!r} reads {slot!r} in some alternatives only, and "
                                         f"it is not a pattern input")
                if len(self.compiled.root_consumers[edge.index]) > 1:
                    raise NotCompilable(f"input {self.compiled.root_names[edge.index]!r} is read by choice "
                                         f"{node.name!r} in some alternatives only, and by other pattern ops")
                self.optional_roots.add(edge.index)
        self.expanded = self.expandable()
        for node in self.nodes:
            if node.commutative and self.skippable[node.index] & {"x", "y"}:
                raise NotCompilable(f"commutative op {node.name!r} has an optional constant x or y")
        self.root_first = self._first_root_edges()

    def _first_root_edges(self) -> set[tuple[int, str, int]]:
        """The (node, slot, position) of the first edge reaching each root, in plan and slot order."""
        seen: set[int] = set() if self.root is None else {self.root}
        first: set[tuple[int, str, int]] = set()
        for st in self.plan:
            for slot, edge in self.nodes[st.node].inputs.items():
                for pos, e in edge_positions(edge):
                    if e.kind == "root" and e.index not in seen:
                        seen.add(e.index)
                        first.add((st.node, slot, pos))
        return first

    def open_loop(self, header: str) -> None:
        """A choice point: everything emitted until the end of the search is nested in it."""
        self.line(header)
        self.depth += 1
        self.loops += 1

    # -- steps --------------------------------------------------------------------------------------

    def up_step(self, i: int, st: Step) -> None:
        """Step ``i``: the producer of a bound operand, one candidate (no choice point)."""
        src = self.nodes[st.src]
        m = st.node
        self.comment(
            f"step {i}: up to {self.label(m)}, the producer of {src.name}.{st.slot}"
            + (f"[{st.pos}]" if st.pos >= 0 else "")
            + (f" (output {st.out})" if st.out else "")
        )
        var = self.value(st.src, st.slot, st.pos)
        self.line(f"_v = {var}")
        self.line(f"o{m} = _v._op")
        self.guard(f"o{m} is None", "a graph input, not an op output")
        self.line(f"_outs = o{m}._output_vars")
        if st.out == 0:
            self.guard("not _outs or _outs[0] is not _v", "not the producer's output 0")
        else:
            self.guard(f"len(_outs) <= {st.out} or _outs[{st.out}] is not _v",
                       f"not the producer's output {st.out}")
        self.line("nb += 1")
        self.bind(m, via=(st.src, st.slot, st.pos), filtered=False, outputs="_outs")

    def down_step(self, i: int, st: Step) -> None:
        """Step ``i``: a loop over the distinct consumers of a bound variable of the accepted types."""
        m = st.node
        node = self.nodes[m]
        if st.src_kind == "root":
            var, what = f"r{st.src}", f"root {self.compiled.root_names[st.src]!r}"
        else:
            var = f"o{st.src}._output_vars[{st.out}]"
            what = f"{self.nodes[st.src].name} (output {st.out})"
        if node.choice is not None and st.pos < 0 and choice_search.enterable(node.choice, st.slot):
            self.comment(f"step {i}: down into {self.label(m)}: each alternative entered from {what}")
            inline = self.inline_alternatives(m, (st.slot, var))  # each alternative's entry root is that variable
            if not inline:
                self.call_helper(m, f"_entered(_m, {self.constant('choice', node.choice)}, {st.slot!r}, {var}, block",
                                 entered=True)
            self.sub_match_checks(m, via=None, entered=True, entry=st.slot if inline else "")
            return
        self.comment(f"step {i}: down to {self.label(m)}, each distinct consumer of {what}")
        if node.choice is not None:
            choice = self.constant("choice", node.choice)
            self.open_loop(f"for o{m} in _below({var}, {choice}):  # ops the choice may end with, below it")
        else:
            self.line(f"_c{i} = {var}._child_ops")
            self.open_loop(f"for o{m} in (_c{i} if len(_c{i}) < 2 else dict.fromkeys(_c{i})):")
        self.guard(self.type_mismatch(f"o{m}", node), "type")
        if same := self.already_matched(m):
            self.guard(same, "already matched")
        self.line("nb += 1")
        self.bind(m, via=None, filtered=True)
