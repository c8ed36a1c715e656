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
5. **Success** builds the :class:`~pattern_infra.pattern.Pattern` with ``Pattern._of_search``, which
   takes its dicts (ops, operands, constants), written out as literals, without copying them (the
   interpreter's ``binding.build_pattern`` gives equal patterns): the constants' insertion sequence of
   ``binding.build_pattern`` is played at generation time. It is returned when there is no ``accept`` or
   ``accept`` returns ``True``; otherwise the innermost loop goes on to the next structural match, as
   the interpreter backtracks.
   ``Matcher.bind_attempts`` is counted in a local and added once, in a ``finally`` (so also when a
   check raises), by the same rule as the interpreter: the anchor, every producer reached by an up-step,
   every consumer of the right type not already bound. The matcher is the function's first argument.
6. **Compilation** registers the source with :mod:`linecache` under the file name
   ``<pattern_infra.codegen:{pattern}:{anchor}>`` (tracebacks show the generated lines) and keeps it on
   the function as ``__source__``; ``Matcher.source(anchor)`` returns it.

Not compiled (the matcher keeps the interpreter for that pattern, or that anchor): patterns with a fan-out
op (``fanout=``); a commutative op whose ``x`` or ``y`` is a wildcard constant an alternative op type may
lack; plans with more nested choice points than CPython compiles (its limit of 20 statically nested
blocks, the function's ``try`` included, so 19 loops: the largest registered pattern has 19).

One deliberate difference: a list or tuple in ``x`` or ``y`` of a commutative op (which MIL's binary ops cannot
hold) makes the interpreter raise ``AttributeError`` while it ranks the operand orders; the compiled
search rejects that binding instead.

Debugging: with ``PATTERN_INFRA_INTERPRET=1`` in the environment (read at every ``match_at``, through
``os.environ``'s own mapping: one dict lookup), every search runs in the interpreter.
"""

from __future__ import annotations

import linecache
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.var import InternalVar

from . import choice_search
from .binding import build_pattern
from .compiler import COMMUTATIVE_OPS, Edge, PatternNode, edge_positions
from .pattern import Pattern
from .plan import DOWN, Step, optional_const

if TYPE_CHECKING:
    from .matcher import Matcher
    from .pattern import Pattern

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

_DIRECT_COMPARISONS = 4
"""Up to this many matched ops, "is the producer one of them" compares identities without a type test."""

_FLOAT_TYPES: frozenset[type] = frozenset({float, np.float16, np.float32, np.float64})
"""Types of a constant's ``val`` for which ``float(val)`` is what ``ConstRule.accepts`` compares."""

_PLAIN_VALUES: frozenset[type] = _FLOAT_TYPES | {
    int, bool, np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64
}
"""Types of a constant's raw value that coremltools never considers symbolic: for them ``var.val`` (which
runs ``any_symbolic``) is the raw ``var._sym_val.val``. So is a numpy array of a non-object dtype."""

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


class _NotCompilable(Exception):
    """The plan has a feature the generator leaves to the interpreter."""


def _filename(matcher: Matcher, anchor: int | str, source: str) -> str:
    """``<pattern_infra.codegen:{pattern}:{anchor}>``, numbered (``...:{anchor}#2>``) when another pattern
    of the same name already registered different lines under it."""
    base = f"<pattern_infra.codegen:{matcher.compiled.name}:{anchor}"
    filename, k = base + ">", 1
    while len(linecache.cache.get(filename, ())) == 4 and "".join(linecache.cache[filename][2]) != source:
        k += 1
        filename = f"{base}#{k}>"
    return filename


def build(matcher: Matcher, anchor: int, collect: bool = False, root: int | None = None) -> GeneratedSearch:
    """Generates and compiles the search of ``matcher`` anchored at pattern op ``anchor``.

    Args:
        matcher: The matcher (its plans, pattern and counters are used by the function).
        anchor: Index of the anchor pattern op.
        collect: Generate ``search(_m, op, block)`` returning *every* complete structural match as
            search state ``(ops, assign, roots, subs)``, as the interpreter's collecting search does for
            an alternative of a choice (:mod:`pattern_infra.choices`), instead of the first accepted
            Pattern.
        root: With ``collect``: the search entered from this root's variable (``op`` is that
            variable; ``Matcher.root_plans``), for an alternative reached by a down-step.

    Returns:
        The generated search; its ``function`` is None when the pattern needs the interpreter.
    """
    try:
        source, namespace = generate(matcher, anchor, collect, root)
    except _NotCompilable as exc:
        text = _not_compiled(matcher, anchor, str(exc))
        return GeneratedSearch(text, _filename(matcher, anchor, text), None, str(exc))
    where = anchor if root is None else f"r{root}"
    filename = _filename(matcher, where, source)
    try:
        code = compile(source, filename, "exec")
    except SyntaxError as exc:  # too many statically nested blocks: more choice points than CPython allows
        reason = f"does not compile: {exc.msg}"
        logger.debug("%s anchor %d left to the interpreter: %s", matcher.compiled.name, anchor, reason)
        return GeneratedSearch(_not_compiled(matcher, anchor, reason) + source, filename, None, reason)
    exec(code, namespace)  # noqa: S102 - our own generated source
    function = namespace["search"]
    function.__source__ = source
    function.__qualname__ = function.__name__ = f"search_{_identifier(matcher.compiled.name)}_{where}"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return GeneratedSearch(source, filename, function)


def _not_compiled(matcher: Matcher, anchor: int, reason: str) -> str:
    name = matcher.compiled.name
    return f"# {name}, anchor {anchor}: not compiled ({reason}); the interpreter searches it\n"


def _identifier(text: str) -> str:
    return re.sub(r"\W", "_", text)


def generate(
    matcher: Matcher, anchor: int, collect: bool = False, root: int | None = None
) -> tuple[str, dict[str, Any]]:
    """The source of the search anchored at ``anchor`` (or entered from ``root``, see :func:`build`) and
    the globals it runs with.

    Raises:
        _NotCompilable: The pattern has a feature left to the interpreter (see the module docstring).
    """
    return _Generator(matcher, anchor, collect, root).run()


class _Generator:
    """Writes the search of one anchor, step by step of its plan."""

    def __init__(self, matcher: Matcher, anchor: int, collect: bool = False, root: int | None = None) -> None:

        self.collect = collect
        """Collect every structural match (an alternative's search) instead of returning the first."""

        self.m = matcher
        self.compiled = matcher.compiled
        self.nodes: list[PatternNode] = matcher.nodes
        self.root = root
        """The root the search is entered from (its variable is ``op``), or None: anchored at an op."""
        self.plan = matcher.plans[anchor] if root is None else matcher.root_plans[root]
        self.anchor = self.plan[0].node
        self.lines: list[str] = []
        self.depth = 1  # indentation, in levels of four spaces
        self.loops = 0  # enclosing for loops
        self.bound: list[int] = []  # pattern ops bound so far, in plan order
        self.namespace: dict[str, Any] = {
            "_InternalVar": InternalVar,
            "_Var": Var,
            "_NOT_A_VALUE": (InternalVar, list, tuple),
            "_SEQ": (list, tuple),
            "_ndarray": np.ndarray,
            "_PLAIN_VALUES": _PLAIN_VALUES,
            "_FLOAT_TYPES": _FLOAT_TYPES,
            "_tn": _OP_TYPE_NAMES.get,
            "_learn_op_type": _learn_op_type,
            "_of_search": Pattern._of_search,
            "_build_pattern": build_pattern,
            "_choice_matches": choice_search.choice_matches,
            "_entered": choice_search.entered_matches,
            "_below": choice_search.candidates_below,
            "_clashes": choice_search.clashes,
            "_in_subs": choice_search.op_in_subs,
            "_subs_final_ok": choice_search.subs_final_ok,
            "_FINALS": tuple(self.compiled.nodes[i].name for i in self.compiled.final_nodes),
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
        return ["continue"] if self.loops else [self.no_more()]

    def no_more(self) -> str:
        """The end of the search when nothing (more) matches."""
        return "return _found" if self.collect else "return None"

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
        if len(node.op_types) == 1:
            return f"{self.op_type(op)} != {node.op_type!r}"
        return f"{self.op_type(op)} not in {_set_literal(node.op_types)}"

    def label(self, n: int) -> str:
        node = self.nodes[n]
        return f"{node.name!r} ({node.op_type_label})"

    # -- the function -------------------------------------------------------------------------------

    def run(self) -> tuple[str, dict[str, Any]]:
        if any(node.fanout for node in self.nodes):
            raise _NotCompilable("the pattern has a fan-out op")
        self.choice_nodes = [node.index for node in self.nodes if node.choice is not None]
        self.optional_roots: set[int] = set()
        for n in self.choice_nodes:
            node = self.nodes[n]
            for slot, edge in node.inputs.items():
                if slot in node.choice.full_slots:
                    continue
                if not isinstance(edge, Edge) or edge.kind != "root":
                    raise _NotCompilable(f"choice {node.name!r} reads {slot!r} in some alternatives only, and "
                                         f"it is not a pattern input")
                if len(self.compiled.root_consumers[edge.index]) > 1:
                    raise _NotCompilable(f"input {self.compiled.root_names[edge.index]!r} is read by choice "
                                         f"{node.name!r} in some alternatives only, and by other pattern ops")
                self.optional_roots.add(edge.index)
        for node in self.nodes:
            if node.commutative and self.skippable[node.index] & {"x", "y"}:
                raise _NotCompilable(f"commutative op {node.name!r} has an optional constant x or y")
        root_first = self._first_root_edges()
        self.root_first = root_first
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
        self.line("def search(_m, op, block):" if self.collect else "def search(_m, op, block, order, accept):")
        self.depth = 1
        self.line("nb = 1" if self.root is None else "nb = 0")
        if self.collect:
            self.line("_found = []")
        self.line("try:")
        self.depth = 2
        a = self.anchor
        if self.root is None:
            self.line(f"o{a} = op")
            self.comment(f"step 0: anchor {self.label(a)}")
            self.bind(a, via=None, filtered=False)
        else:
            self.line(f"r{self.root} = op  # entered from root {compiled.root_names[self.root]!r}")
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
        self.depth = 2
        self.loops = 0
        self.line(self.no_more())
        self.depth = 1
        self.line("finally:  # every exit, an exception included, counts the bind attempts made")
        self.line("    _m.bind_attempts += nb")
        return "\n".join(header + self.lines) + "\n", self.namespace

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
            choice = self.constant("choice", node.choice)
            self.open_loop(f"for _s{m} in _entered(_m, {choice}, {st.slot!r}, {var}, block, None, "
                           f"{node.is_final}):")
            self.line(f"o{m} = _s{m}.end")
            self.sub_match_checks(m, via=None)
            return
        self.comment(f"step {i}: down to {self.label(m)}, each distinct consumer of {what}")
        if node.choice is not None:
            choice = self.constant("choice", node.choice)
            self.open_loop(f"for o{m} in _below({var}, {choice}):  # ops the choice may end with, below it")
        else:
            self.line(f"_c{i} = {var}._child_ops")
            self.open_loop(f"for o{m} in (_c{i} if len(_c{i}) < 2 else dict.fromkeys(_c{i})):")
        self.guard(self.type_mismatch(f"o{m}", node), "type")
        same = self.possibly_same(m)
        if same:
            self.guard(" or ".join(f"o{m} is o{j}" for j in same), "already matched")
        self.line("nb += 1")
        self.bind(m, via=None, filtered=True)

    def possibly_same(self, n: int) -> list[int]:
        """Bound pattern ops whose program op could be the one about to bind to ``n`` (types overlap)."""
        types = self.nodes[n].op_types
        return [j for j in self.bound if self.nodes[j].op_types & types]

    # -- binding one op -----------------------------------------------------------------------------

    def bind(
        self, n: int, via: tuple[int, str, int] | None, filtered: bool, outputs: str = ""
    ) -> None:
        """Checks ``o<n>`` against pattern op ``n`` and sets its operand locals (opens a loop if it may swap).

        Args:
            n: The pattern op.
            via: For an up-step, the consumer edge it came along (already checked).
            filtered: Type and injectivity were checked by the enclosing down-step loop.
            outputs: A local already holding ``o<n>._output_vars``, if any.
        """
        node = self.nodes[n]
        o = f"o{n}"
        if not filtered:
            self.guard(self.type_mismatch(o, node), "type")
        self.guard(f"len({outputs or o + '._output_vars'}) != {node.num_outputs}", "number of outputs")
        self.guard(f"{o}.enclosing_block is not block", "another block")
        if not filtered:
            same = self.possibly_same(n)
            if same:
                self.guard(" or ".join(f"{o} is o{j}" for j in same), "already matched")
        if node.choice is not None:
            self.bind_choice(n, via)
            return
        swap = self.swap_mode(node)
        swapped = {"x", "y"} if swap else set()
        # x and y checked per order when the pattern has a tuple in one of them (an order may move it)
        xy_later = bool(swap) and any(isinstance(node.inputs[s], tuple) for s in ("x", "y"))
        self.line(f"_iv = {o}._input_vars")
        for slot, edge in node.inputs.items():
            name = self.raw(n, slot) if slot in swapped else self.value(n, slot)
            self.line(f"{name} = _iv.get({slot!r})")
            if slot in self.skippable[n]:
                self.line(f"if type({name}) is not _Var:")
                self.depth += 1
                self.line(f"if {name} is None or isinstance({name}, _InternalVar):")
                self.depth += 1
                self.guard(f"{self.op_type(o)} == {node.op_type!r}", f"missing operand {slot!r}")
                self.line(f"{name} = None  # an alternative op type without this wildcard constant")
                self.depth -= 1
                self.line(f"elif isinstance({name}, _SEQ):  # {node.name}.{slot} is a single value")
                self.depth += 1
                for text in self.fail_lines():
                    self.line(text)
                self.depth -= 2
            elif slot in swapped and xy_later:
                self.guard(f"{name} is None or isinstance({name}, _InternalVar)", f"missing operand {slot!r}")
            elif isinstance(edge, tuple):
                self.guard(f"not isinstance({name}, _SEQ) or len({name}) != {len(edge)}",
                           f"missing operand {slot!r}, or not {len(edge)} values")
            else:  # a plain Var is neither missing, internal nor a tuple
                self.guard(
                    f"type({name}) is not _Var and ({name} is None or isinstance({name}, _NOT_A_VALUE))",
                    f"missing operand {slot!r}, or a tuple",
                )
        if swap:
            self.operand_orders(n, swap)
        # edges to bound consumers: independent of the operand order
        for consumer, slot, pos, out in node.consumers:
            if consumer not in self.bound or via == (consumer, slot, pos):
                continue
            self.guard(
                f"{self.value(consumer, slot, pos)} is not {o}._output_vars[{out}]",
                f"{self.nodes[consumer].name}.{slot} reads {node.name}",
            )
        fixed = [slot for slot in node.inputs if slot not in swapped]
        self.op_edge_checks(n, fixed)
        if swap:
            self.const_checks(n, fixed)
            self.open_loop(f"for {self.value(n, 'x')}, {self.value(n, 'y')} in _ord{n}:")
            if xy_later:
                self.structure_checks(n, ["x", "y"])
            self.op_edge_checks(n, ["x", "y"])
            self.root_checks(n)
            self.const_checks(n, ["x", "y"])
        else:
            self.root_checks(n)
            self.const_checks(n, fixed)
        self.bound.append(n)

    def bind_choice(self, n: int, via: tuple[int, str, int] | None) -> None:
        """A choice node: a loop over the sub-matches of its alternatives ending at ``o<n>`` (the helper
        the interpreter calls, :func:`~pattern_infra.choice_search.choice_matches`), its slots read from each."""
        node = self.nodes[n]
        choice = self.constant("choice", node.choice)
        self.comment(f"choice {node.name!r}: every match of each alternative ending at o{n}")
        self.open_loop(f"for _s{n} in _choice_matches(_m, {choice}, o{n}, block, None, {node.is_final}):")
        self.sub_match_checks(n, via)

    def sub_match_checks(self, n: int, via: tuple[int, str, int] | None) -> None:
        """Choice node ``n`` bound to ``o<n>`` with the sub-match ``_s<n>``: injectivity, then its slots
        checked like any operands (``Search.bind_sub``)."""
        node = self.nodes[n]
        bound = ", ".join(f"o{j}" for j in self.bound)
        subs = ", ".join(f"_s{j}" for j in self.bound if j in self.choice_nodes)
        self.guard(f"_clashes(_s{n}, ({bound}{',' if bound else ''}), ({subs}{',' if subs else ''}))",
                   "an op of the alternative is already matched")
        self.line(f"_sl = _s{n}.slots")
        for slot in node.inputs:
            get = f"_sl[{slot!r}]" if slot in node.choice.full_slots else f"_sl.get({slot!r})"
            self.line(f"{self.value(n, slot)} = {get}")
        for consumer, slot, pos, out in node.consumers:
            if consumer not in self.bound or via == (consumer, slot, pos):
                continue
            self.guard(
                f"{self.value(consumer, slot, pos)} is not o{n}._output_vars[{out}]",
                f"{self.nodes[consumer].name}.{slot} reads {node.name}",
            )
        slots = list(node.inputs)
        self.op_edge_checks(n, slots)
        self.root_checks(n)
        self.const_checks(n, slots)
        self.bound.append(n)

    def swap_mode(self, node: PatternNode) -> str:
        """``""`` (never swapped), ``"always"`` or ``"by_type"`` (only for commutative program op types)."""
        if not node.commutative:
            return ""
        if node.swap_any_type or node.op_types <= COMMUTATIVE_OPS:
            return "always"
        if not node.op_types & COMMUTATIVE_OPS:
            return ""
        return "by_type"

    def operand_orders(self, n: int, swap: str) -> None:
        """``_ord<n>``: the operand orders to try, in the interpreter's order (``Search.assignments``)."""
        node = self.nodes[n]
        ax, ay = self.raw(n, "x"), self.raw(n, "y")
        as_written, swapped = f"(({ax}, {ay}), ({ay}, {ax}))", f"(({ay}, {ax}), ({ax}, {ay}))"
        self.comment(f"operand orders of {node.name}: as written, then swapped")
        single = f"{ax} is {ay}"
        if swap == "by_type":
            commutative = _set_literal(node.op_types & COMMUTATIVE_OPS)
            single = f"{self.op_type(f'o{n}')} not in {commutative} or {single}"
        self.line(f"if {single}:")
        self.line(f"    _ord{n} = (({ax}, {ay}),)")
        cx, cy = (_is_const_edge(node.inputs[s]) for s in ("x", "y"))
        if cx != cy:
            # The interpreter's rule (_const_fit): swapped first when that puts more compile-time
            # constants where the pattern has its constant. With one constant slot that is when the
            # operand in the other slot (``wrong``) is a constant and the one in it (``right``) is not:
            # ``wrong > right`` on bools, both evaluated as the interpreter does.
            wrong, right = (ax, ay) if cy else (ay, ax)
            self.line(
                f"elif {self.is_const_var(wrong, 'kw')} > {self.is_const_var(right, 'kr')}:"
                f"  # the constant on the wrong side: swapped first"
            )
            self.line(f"    _ord{n} = {swapped}")
        self.line("else:")
        self.line(f"    _ord{n} = {as_written}")

    def is_const_var(self, var: str, tmp: str) -> str:
        """Whether ``var`` is the output of a ``const`` op (``Search._const_fit``)."""
        return f"((_{tmp} := {var}._op) is not None and {self.op_type('_' + tmp)} == 'const')"

    def structure_checks(self, n: int, slots: list[str]) -> None:
        """Tuple slots hold tuples of the pattern's length; other slots hold no tuple."""
        node = self.nodes[n]
        for slot in slots:
            edge = node.inputs[slot]
            name = self.value(n, slot)
            if isinstance(edge, tuple):
                self.guard(f"not isinstance({name}, _SEQ) or len({name}) != {len(edge)}",
                           f"{node.name}.{slot} has {len(edge)} values")
            else:
                self.guard(f"isinstance({name}, _SEQ)", f"{node.name}.{slot} is a single value")

    def op_edge_checks(self, n: int, slots: list[str]) -> None:
        """Operands wired from a bound pattern op are that op's very output."""
        node = self.nodes[n]
        for slot in slots:
            for pos, e in edge_positions(node.inputs[slot]):
                if e.kind == "op" and e.index in self.bound:
                    self.guard(
                        f"{self.value(n, slot, pos)} is not o{e.index}._output_vars[{e.output}]",
                        f"{node.name}.{slot} reads {self.nodes[e.index].name}",
                    )

    def root_checks(self, n: int) -> None:
        """The first edge reaching a root binds it; every later one compares with it."""
        node = self.nodes[n]
        for slot, edge in node.inputs.items():
            for pos, e in edge_positions(edge):
                if e.kind != "root":
                    continue
                var = self.value(n, slot, pos)
                name = self.compiled.root_names[e.index]
                if (n, slot, pos) in self.root_first:
                    self.line(f"r{e.index} = {var}  # root {name!r}")
                else:
                    self.guard(f"{var} is not r{e.index}", f"root {name!r} bound consistently")

    def const_checks(self, n: int, slots: list[str]) -> None:
        """The constant rules of op ``n``'s constant slots among ``slots``."""
        node = self.nodes[n]
        for slot in slots:
            for pos, e in edge_positions(node.inputs[slot]):
                if e.kind == "const":
                    self.const_check(self.value(n, slot, pos), e.index)

    def const_check(self, var: str, index: int) -> None:
        """The constant rule of ``var``; ``var.val`` is read through its raw value when that is plain."""
        key, expected, rule = self.compiled.consts[index]
        if rule.mode == "any":
            return
        where = f"constant {key}"
        self.line(f"_sv = {var}._sym_val")
        self.guard(f"_sv is None or (_val := _sv.val) is None", f"{where}: a compile-time constant")
        if rule.mode == "const" or expected is None:
            self.guard(
                f"type(_val) not in _PLAIN_VALUES and (type(_val) is not _ndarray or _val.dtype.kind == 'O') "
                f"and {var}.val is None",
                f"{where}: not symbolic",
            )
            return
        accepts = self.constant("accepts", rule.accepts)
        value = self.constant("expected", expected)
        general = f"{accepts}({var}, {value}) is not None"
        if expected.size == 1 and expected.dtype.kind in "biuf":
            e = float(expected.reshape(()))
            tol = rule.atol + rule.rtol * abs(e)  # the very float ConstRule.accepts compares with
            e_text = repr(e) if math.isfinite(e) else self.constant("e", e)
            tol_text = repr(tol) if math.isfinite(tol) else self.constant("tol", tol)
            close = f"abs(float(_val) - {e_text}) <= {tol_text}"
            self.guard(
                f"not ({close}) if type(_val) in _FLOAT_TYPES else {general}", f"{where} close to {e!r}"
            )
            return
        self.guard(general, f"{where}: ConstRule.accepts")

    # -- end of the search --------------------------------------------------------------------------

    def final_checks(self) -> None:
        """``Search.final_checks``, written out for the nodes and slots of the pattern."""
        self.comment("final checks: intermediates used only inside the match and not block outputs")
        for node in self.nodes:
            if node.is_final:
                continue
            for j in range(node.num_outputs):
                self.line(f"_w = o{node.index}._output_vars[{j}]")
                self.guard(
                    f"_w.consuming_blocks or len(_w._child_ops) != {node.output_uses[j]}",
                    f"{node.name} output {j}: used {node.output_uses[j]} time(s), inside the match",
                )
        matched = " or ".join(f"_p is o{n}" for n in range(len(self.nodes)))
        subs = "(" + "".join(f"_s{n}, " for n in self.choice_nodes) + ")"
        if self.choice_nodes:
            matched = f"{matched} or _in_subs(_p, {subs})"
        if len(self.nodes) > _DIRECT_COMPARISONS or self.choice_nodes:  # first rule out by type
            matched = f"{self.op_type('_p')} in {_set_literal(self.m.op_types)} and ({matched})"
        self.comment("final checks: no root and no constant slot computed by a matched op")
        for k, name in enumerate(self.compiled.root_names):
            if k in self.optional_roots:  # read by some alternatives only: None when another matched
                self.line(f"_p = r{k}._op if r{k} is not None else None")
                self.guard(f"_p is not None and {matched}", f"root {name!r} computed inside the match")
                continue
            self.line(f"_p = r{k}._op")
            self.guard(f"_p is not None and {matched}", f"root {name!r} computed inside the match")
        for n, slot, pos in self.m.const_slots:
            var = self.value(n, slot, pos)
            optional = slot in self.skippable[n]
            if optional:
                self.line(f"if {var} is not None:")
                self.depth += 1
            self.line(f"_p = {var}._op")
            self.guard(f"_p is not None and {matched}",
                       f"constant slot {self.nodes[n].name}.{slot} computed inside the match")
            if optional:
                self.depth -= 1

    def collected(self) -> None:
        """Collect mode: the search state of the match is kept and the search goes on (the interpreter's
        ``Collecting.final_checks``)."""
        if any(self.skippable):
            raise _NotCompilable("an alternative op type may lack a wildcard constant (collect mode)")
        per_node = ", ".join(f"_s{n}" if n in self.choice_nodes else "None" for n in range(len(self.nodes)))
        if self.choice_nodes:
            subs = "(" + "".join(f"_s{n}, " for n in self.choice_nodes) + ")"
            self.guard(f"not _subs_final_ok(({', '.join(f'o{n}' for n in range(len(self.nodes)))},), {subs})",
                       "no constant slot of an alternative computed inside the match")
        assign = ", ".join(
            f"_s{node.index}.slots" if node.choice is not None
            else "{" + ", ".join(f"{slot!r}: {self.value(node.index, slot)}" for slot in node.inputs) + "}"
            for node in self.nodes
        )
        ops = ", ".join(f"o{n}" for n in range(len(self.nodes)))
        roots = ", ".join(f"r{k}" for k in range(len(self.compiled.root_names)))
        self.comment("a match: kept, and the search goes on")
        self.line(f"_found.append(([{ops}], [{assign}], [{roots}], [{per_node}]))")

    def success(self) -> None:
        """Builds the Pattern as ``binding.build_pattern`` would, its dicts written out (for a pattern
        with choices, by calling it: the alternatives' ops, operands and constants are merged in)."""
        if self.choice_nodes:
            subs = "(" + "".join(f"_s{n}, " for n in self.choice_nodes) + ")"
            self.guard(f"not _subs_final_ok(({', '.join(f'o{n}' for n in range(len(self.nodes)))},), {subs})",
                       "no constant slot of an alternative computed inside the match")
            self.comment("a match: binding.build_pattern, with the sub-matches of the choices")
            assign = ", ".join(
                f"_s{node.index}.slots" if node.choice is not None
                else "{" + ", ".join(f"{slot!r}: {self.value(node.index, slot)}" for slot in node.inputs) + "}"
                for node in self.nodes
            )
            per_node = ", ".join(f"_s{n}" if n in self.choice_nodes else "None" for n in range(len(self.nodes)))
            ops = ", ".join(f"o{n}" for n in range(len(self.nodes)))
            roots = ", ".join(f"r{k}" for k in range(len(self.compiled.root_names)))
            self.line(f"_p = _build_pattern(_m, block, [{ops}], [{assign}], [{roots}], order, [{per_node}])")
            self.line("if accept is None or accept(_p) is True:")
            self.line("    return _p")
            return
        self._success_plain()

    def _success_plain(self) -> None:
        """Builds the Pattern as ``binding.build_pattern`` would, its dicts written out.

        Skipped wildcard slots (None) leave their entries out; when every such slot is present, which is
        the common case, the dicts are plain literals.
        """
        compiled = self.compiled
        self.comment("a match: the dicts of binding.build_pattern, written out")
        optional = [self.value(n, slot) for n in range(len(self.nodes)) for slot in self.nodes[n].inputs
                    if slot in self.skippable[n]]
        ops = ", ".join(f"{node.name!r}: o{node.index}" for node in self.nodes)
        roots = ", ".join(f"r{k}" for k in range(len(compiled.root_names)))
        if optional:
            self.line(f"if {' and '.join(f'{v} is not None' for v in optional)}:")
            self.depth += 1
            self.emit_new_pattern(ops, roots, with_skips=False)
            self.depth -= 1
            self.line("else:  # an alternative op type without some wildcard constant")
            self.depth += 1
            self.emit_new_pattern(ops, roots, with_skips=True)
            self.depth -= 1
        else:
            self.emit_new_pattern(ops, roots, with_skips=False)

    def emit_new_pattern(self, ops: str, roots: str, with_skips: bool) -> None:
        """``_p = _of_search(...)`` (``Pattern._of_search``), returned if accepted; ``with_skips`` leaves out the wildcard
        slots that are None."""
        operands = []
        for node in self.nodes:
            n = node.index
            items = ", ".join(f"{slot!r}: {self.value(n, slot)}" for slot in node.inputs)
            if with_skips and self.skippable[n]:
                self.line(f"_d{n} = {{{items}}}")
                for slot in node.inputs:
                    if slot in self.skippable[n]:
                        self.line(f"if {self.value(n, slot)} is None:")
                        self.line(f"    del _d{n}[{slot!r}]")
                operands.append(f"{node.name!r}: _d{n}")
            else:
                operands.append(f"{node.name!r}: {{{items}}}")
        entries = list(zip(self.m.const_slots, self.compiled.consts, self.compiled.const_names))
        if with_skips:
            self.line("_k = {}")
            for (n, slot, pos), (key, _, _), cname in entries:
                var = self.value(n, slot, pos)
                skippable = slot in self.skippable[n]
                if skippable:
                    self.line(f"if {var} is not None:")
                    self.depth += 1
                self.line(f"_k[{key!r}] = {var}")
                self.line(f"_k.setdefault({cname!r}, {var})")
                if skippable:
                    self.depth -= 1
            consts = "_k"
        else:  # the same insertion sequence, played at generation time
            played: dict[str, str] = {}
            for (n, slot, pos), (key, _, _), cname in entries:
                var = self.value(n, slot, pos)
                played[key] = var
                played.setdefault(cname, var)
            consts = "{" + ", ".join(f"{k!r}: {v}" for k, v in played.items()) + "}"
        self.line("_p = _of_search(")
        self.line(f"    _m.compiled, block, {{{ops}}}, [{roots}],")
        self.line(f"    {{{', '.join(operands)}}},")
        self.line(f"    {consts},")
        self.line("    order,")
        self.line("    _FINALS,")
        self.line(")")
        self.line("if accept is None or accept(_p) is True:")
        self.line("    return _p")


def _set_literal(values: frozenset[str]) -> str:
    """A set display of constants: CPython folds ``x in {...}`` into a frozenset constant."""
    return "{" + ", ".join(repr(v) for v in sorted(values)) + "}"


def _is_const_edge(edge: Edge | tuple[Edge, ...]) -> bool:
    return isinstance(edge, Edge) and edge.kind == "const"


