"""Find a compiled pattern in a block: anchored, typed, backtracking search.

Algorithm (per pattern, per block):

1. **Plans, once per pattern.** For every pattern op taken as the *anchor*, a search order is computed
   at registration: starting from the anchor, each further op is reached either *up* (the producer of an
   input slot of an op already placed: a single candidate) or *down* (a consumer of a variable already
   bound: one candidate per consumer of the right type). Up-steps are preferred; down-steps are only
   needed for patterns with several outputs or ops joined through an input.
2. **Anchor, once per block.** The driver indexes the block's ops by type; the anchor is the pattern op
   whose type is rarest in the block, so most program ops are never looked at.
3. **Binding an op** checks, in this order and before any recursion: op type (one of the
   alternatives), number of outputs, same block, not already bound (a match is injective); then each
   operand order the op allows (two for commutative ops, tried in place: no pattern copies); then every
   data edge whose both ends are now bound: roots bound consistently, constants satisfying their rule,
   producers and consumers being the very same variables.
4. **Backtracking** undoes the bindings of a failed branch (ops, operand orders, roots).
5. **Final checks** on a complete binding: outputs of non-final ops have exactly the pattern's uses
   (so no consumer outside the match) and are not block outputs; no root and no constant slot is
   computed inside the match. Then the caller's ``accept`` (the user's constraints, the transform)
   decides: anything but ``True`` backtracks into the search, which goes on to the next structural
   match at the same anchor. The user's rule is a filter on matches, not on the first match found.

6. **Compiled fast path.** ``match_at`` runs each anchor's plan as one generated Python function
   (:mod:`pattern_infra.codegen`, built on first use, read with :meth:`Matcher.source`): the same
   search, choices and counters without the interpreter's calls. Tracing, a root hint, patterns with
   a fan-out op and ``PATTERN_INFRA_INTERPRET=1`` use the interpreter below, which stays the reference.

Cost: for an anchor candidate, each up-step is O(1) and each down-step O(consumers of one variable),
so a pattern with only up-steps costs O(pattern size) per anchor op; the consumers of a variable are
never permuted (no k! enumeration) because each pattern op picks one consumer at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.var import InternalVar

from . import choices, codegen
from .binding import build_pattern, match_dicts, new_pattern
from .plan import DOWN, UP, Failure, Step, input_value, optional_const, slot_value
from .compiler import COMMUTATIVE_OPS, CompiledPattern, Edge, PatternNode, compile_pattern, edge_positions
from .pattern import Pattern

__all__ = [
    "Failure",
    "Matcher",
    "detect_pattern",
    "pattern_detected",
    "lists_op_equality",
]

Accept = Callable[[Pattern], Any]
"""Offered each complete structural match: ``True`` takes it; anything else continues the search (a
``str`` is the reason reported to a tracing search)."""


class Matcher:
    """Searches one compiled pattern; stateless between calls except for counters and compiled searches."""

    def __init__(self, compiled: CompiledPattern) -> None:
        self.compiled = compiled
        self.nodes: list[PatternNode] = compiled.nodes
        self.plans: list[list[Step]] = [self._plan(a) for a in range(len(compiled.nodes))]
        self.root_plans: list[list[Step] | None] = [
            self._plan(entry[0], entry) if (entry := choices.entry_edge(compiled, r)) is not None else None
            for r in range(len(compiled.root_names))
        ]
        """Per root: the search order of a search *entered* from that root's variable (for an alternative
        of a choice reached by a down-step, :func:`~pattern_infra.choices.entered_matches`): a down-step
        to the root's first consumer, then the plan as from that op; None when no consumer can start it."""
        self.joins_through_roots: bool = _parts_meet_only_at_inputs(compiled)
        """Whether some parts of the pattern are joined only through a pattern input they both read: in
        the program they may meet only at a variable shared widely (a deduplicated constant), which a
        revisit does not walk through, so the driver tries a changed op itself as each pattern op of its
        type. Otherwise every op of a match is reachable from any other through data edges."""
        self.radius: list[int] = self._radii()
        """Per anchor: producer/consumer hops from the anchor op within which any op of a match lies,
        plus one (an op just outside the match, such as a root's producer, can unblock it)."""
        self.op_types: frozenset[str] = choices.all_op_types(compiled)
        """Every op type a match may contain (the alternatives' ops included)."""
        self.type_groups: tuple[tuple[str, ...], ...] = tuple(
            dict.fromkeys(tuple(sorted(n.op_types)) for n in compiled.nodes)
        )
        """The pattern ops' type sets, each once: a block can hold a match only if it has an op of
        every group."""
        self.has_choices: bool = any(n.choice is not None for n in compiled.nodes)
        """Whether the pattern has a choice node (``one_of``, ``equivalences=``)."""
        self.anchors_by_type: dict[str, tuple[int, ...]] = {}
        """Program op type to the pattern ops (anchors) that accept it; fan-out ops excluded."""
        for node in compiled.nodes:
            if not node.fanout:
                for t in sorted(node.op_types):
                    self.anchors_by_type[t] = (*self.anchors_by_type.get(t, ()), node.index)
        self.const_slots = [
            (node.index, slot, pos)
            for node in compiled.nodes
            for slot, edge in node.inputs.items()
            for pos, e in edge_positions(edge)
            if e.kind == "const"
        ]
        self.attempts = 0
        """Anchor ops tried (across calls)."""
        self.bind_attempts = 0
        """Op bindings tried, anchors included (across calls): the matcher's unit of work."""
        self._compiled_fns: list[Any] = [_NOT_BUILT] * len(compiled.nodes)
        """Per anchor: the compiled search (:mod:`~pattern_infra.codegen`), None when the interpreter
        must do it, ``_NOT_BUILT`` until first used."""
        self._generated: dict[int, codegen.GeneratedSearch] = {}
        self._collect_fns: dict[int, Any] = {}

    # -- planning -----------------------------------------------------------------------------------

    def _plan(self, anchor: int, entry: tuple[int, str, int, int] | None = None) -> list[Step]:
        """The search order anchored at pattern op ``anchor``; with ``entry`` (node, slot, position, root),
        entered instead from the root's variable by a down-step to that node's slot."""
        nodes = self.nodes
        placed = {anchor}
        roots_bound: set[int] = set()
        if entry is None:
            steps = [Step(UP, anchor, src_kind="anchor")]
        else:
            _, slot, pos, root = entry
            steps = [Step(DOWN, anchor, "root", root, slot, pos)]
            roots_bound.add(root)

        def note_roots(n: int) -> None:
            choice = nodes[n].choice
            for slot, edge in nodes[n].inputs.items():
                if choice is not None and slot not in choice.full_slots:
                    continue  # bound only when the alternative that matched reads it
                for _, e in edge_positions(edge):
                    if e.kind == "root":
                        roots_bound.add(e.index)

        note_roots(anchor)
        while len(placed) < len(nodes):
            step = self._next_up(placed) or self._next_down(placed, roots_bound)
            if step is None:  # compile_pattern guarantees connectivity
                raise RuntimeError(f"pattern {self.compiled.name!r} could not be planned")
            steps.append(step)
            placed.add(step.node)
            note_roots(step.node)
        return steps

    def _radii(self) -> list[int]:
        nodes = self.nodes
        span = [node.choice.depth if node.choice is not None else 1 for node in nodes]
        hops: list[dict[int, int]] = [{} for _ in nodes]
        for node in nodes:
            for _, edge in node.inputs.items():
                for _, e in edge_positions(edge):
                    if e.kind == "op":
                        hops[node.index][e.index] = span[node.index]
                        hops[e.index][node.index] = span[node.index]
        if not self.joins_through_roots:
            return [self._eccentricity(hops, anchor) + 1 for anchor in range(len(nodes))]
        for users in self.compiled.root_consumers:  # two consumers of one variable: 2 hops apart
            for a, _, _ in users:
                for b, _, _ in users:
                    if a != b:
                        hops[a].setdefault(b, span[a] + span[b])
        return [self._eccentricity(hops, anchor) + 1 for anchor in range(len(nodes))]

    @staticmethod
    def _eccentricity(hops: list[dict[int, int]], anchor: int) -> int:
        """The largest number of hops from ``anchor`` to another pattern op (Dijkstra on a tiny graph)."""
        dist = {anchor: 0}
        frontier = [anchor]
        while frontier:  # relax until nothing improves
            nxt = []
            for n in frontier:
                for m, w in hops[n].items():
                    if dist[n] + w < dist.get(m, 1 << 30):
                        dist[m] = dist[n] + w
                        nxt.append(m)
            frontier = nxt
        return max(dist.values())

    def _next_up(self, placed: set[int]) -> Step | None:
        for n in sorted(placed):
            for slot, edge in self.nodes[n].inputs.items():
                for pos, e in edge_positions(edge):
                    if e.kind == "op" and e.index not in placed:
                        return Step(UP, e.index, "op", n, slot, pos, e.output)
        return None

    def _next_down(self, placed: set[int], roots_bound: set[int]) -> Step | None:
        best: tuple[int, int, Step] | None = None
        for m, node in enumerate(self.nodes):
            if m in placed:
                continue
            for slot, edge in node.inputs.items():
                for pos, e in edge_positions(edge):
                    if e.kind == "op" and e.index in placed:
                        step = Step(DOWN, m, "op", e.index, slot, pos, e.output)
                        rank = (0, m)
                    elif e.kind == "root" and e.index in roots_bound:
                        step = Step(DOWN, m, "root", e.index, slot, pos)
                        rank = (1, m)
                    else:
                        continue
                    if best is None or rank < best[:2]:
                        best = (*rank, step)
        return best[2] if best else None

    def choose_anchor(self, type_counts: Mapping[str, int]) -> int:
        """The pattern op whose accepted types are rarest among ``type_counts``; ties go to the last op."""
        best_cost, best = None, 0
        for node in reversed(self.nodes):
            if node.fanout:
                continue
            cost = sum(type_counts.get(t, 0) for t in node.op_types)
            if best_cost is None or cost < best_cost:
                best_cost, best = cost, node.index
        return best

    # -- search -------------------------------------------------------------------------------------

    def match_at(
        self,
        op: Operation,
        block: Block,
        anchor: int,
        *,
        order: Callable[[list[Operation]], list[Operation]] | None = None,
        trace: bool = False,
        root_hint: Var | None = None,
        accept: Accept | None = None,
    ) -> Pattern | Failure | None:
        """Tries to match with ``op`` bound to pattern op number ``anchor``.

        Args:
            op: The program op to place at the anchor.
            block: The block the whole match must lie in.
            anchor: Index of the anchor pattern op.
            order: Sorts captured ops into program order for ``Pattern.op_list``.
            trace: Return a :class:`Failure` describing the nearest miss instead of None.
            root_hint: If given, the first root must be this variable.
            accept: Called with each complete structural match, in search order: ``True`` takes it
                (the search returns it), anything else lets the search go on (a string is the reason
                a tracing search reports). None takes the first match.

        Returns:
            A :class:`Pattern` on success; on failure None, or a :class:`Failure` when tracing.
        """
        self.attempts += 1
        if not trace and root_hint is None and not codegen.interpret_forced():
            fn = self._compiled_fns[anchor]
            if fn is _NOT_BUILT:
                fn = self._build(anchor).function
                self._compiled_fns[anchor] = fn
            if fn is not None:
                return fn(self, op, block, order, accept)
        search = _Search(self, block, self.plans[anchor], trace, order, accept)
        if root_hint is not None:
            search.roots[0] = root_hint
        if search.run(op):
            return search.result
        return search.failure if trace else None

    def source(self, anchor: int) -> str:
        """The Python source of the compiled search anchored at pattern op ``anchor``.

        ``match_at`` runs this function (untraced, without a root hint); it performs the interpreter's
        search step by step of ``plans[anchor]``. For a pattern the generator leaves to the interpreter
        (a fan-out op, see :mod:`pattern_infra.codegen`) the text is a comment saying why.

        Args:
            anchor: Index of the anchor pattern op.

        Returns:
            The generated source, as registered with :mod:`linecache` for tracebacks.
        """
        return self._build(anchor).source

    def collector(self, anchor: int, root: int | None = None) -> Any:
        """The generated search collecting every structural match at ``anchor`` (for an alternative of a
        choice), or, with ``root``, entered from that root's variable (``root_plans``); None when the
        interpreter must do it (``PATTERN_INFRA_INTERPRET=1`` included)."""
        if codegen.interpret_forced():
            return None
        key = anchor if root is None else -1 - root
        fn = self._collect_fns.get(key, _NOT_BUILT)
        if fn is _NOT_BUILT:
            fn = codegen.build(self, anchor, collect=True, root=root).function
            self._collect_fns[key] = fn
        return fn

    def _build(self, anchor: int) -> codegen.GeneratedSearch:
        generated = self._generated.get(anchor)
        if generated is None:
            generated = codegen.build(self, anchor)
            self._generated[anchor] = generated
        return generated


def _parts_meet_only_at_inputs(compiled: CompiledPattern) -> bool:
    """Whether the pattern's ops fall apart once the edges through pattern inputs are left out."""
    part = list(range(len(compiled.nodes)))

    def find(n: int) -> int:
        while part[n] != n:
            n = part[n]
        return n

    for node in compiled.nodes:
        for _, edge in node.inputs.items():
            for _, e in edge_positions(edge):
                if e.kind == "op":
                    part[find(node.index)] = find(e.index)
    return len({find(n) for n in range(len(part))}) > 1


_NOT_BUILT = object()
"""Marks an anchor whose compiled search was not generated yet."""


class _Search:
    """State of one anchored search; undone on backtracking."""

    __slots__ = ("m", "block", "plan", "trace", "ops", "assign", "roots", "used", "failure", "depth",
                 "order", "accept", "result", "subs")

    def __init__(
        self,
        matcher: Matcher,
        block: Block,
        plan: list[Step],
        trace: bool,
        order: Callable[[list[Operation]], list[Operation]] | None = None,
        accept: Accept | None = None,
    ) -> None:
        n = len(matcher.nodes)
        self.m = matcher
        self.block = block
        self.plan = plan
        self.trace = trace
        self.ops: list[Operation | None] = [None] * n
        self.assign: list[dict[str, Any] | None] = [None] * n
        self.roots: list[Var | None] = [None] * len(matcher.compiled.root_names)
        self.used: dict[int, int] = {}
        self.failure: Failure | None = None
        self.depth = 0
        self.order = order
        self.accept = accept
        self.result: Pattern | None = None
        """The match taken, once the search succeeded."""
        self.subs: list[choices.SubMatch | None] = [None] * n
        """Per pattern op, the sub-match of a choice node (None elsewhere)."""

    def fail(self, node: int, reason: str | Callable[[], str]) -> bool:
        if self.trace and (self.failure is None or self.depth > self.failure.bound):
            self.failure = Failure(
                bound=self.depth,
                node=self.m.nodes[node].name,
                reason=reason() if callable(reason) else reason,
                ops={self.m.nodes[i].name: o.name for i, o in enumerate(self.ops) if o is not None},
            )
        return False

    def run(self, anchor_op: Operation) -> bool:
        return self.bind(self.plan[0].node, anchor_op, 0)

    def run_entered(self, root: int, var: Var) -> bool:
        """Runs a plan entered from root ``root`` (``Matcher.root_plans``) bound to ``var``."""
        self.roots[root] = var
        return self.step(0)

    def step(self, i: int) -> bool:
        if i == len(self.plan):
            return self.final_checks()
        st = self.plan[i]
        if st.kind == UP:
            var = self.slot_var(st.src, st.slot, st.pos)
            producer = var.op if var is not None else None
            if producer is None:
                return self.fail(st.node, lambda: f"operand {st.slot} of {self.m.nodes[st.src].name} "
                                 f"is a graph input, not the output of an op")
            outs = producer.outputs
            if st.out >= len(outs) or outs[st.out] is not var:
                return self.fail(st.node, lambda: f"operand {st.slot} of {self.m.nodes[st.src].name} "
                                 f"is not output {st.out} of {producer.name}")
            return self.bind(st.node, producer, i)
        if st.src_kind == "root":
            var = self.roots[st.src]
        else:
            src_op = self.ops[st.src]
            var = src_op.outputs[st.out] if src_op is not None else None
        if var is None:
            return False
        if self.m.nodes[st.node].fanout:
            return self.bind_fanout(st.node, var, i)
        tried = False
        target = self.m.nodes[st.node]
        if target.choice is not None and st.pos < 0 and choices.enterable(target.choice, st.slot):
            return self.enter_choice(st.node, st.slot, var, i)
        candidates = (choices.candidates_below(var, target.choice) if target.choice is not None
                      else dict.fromkeys(var.child_ops))
        for consumer in candidates:
            if consumer.op_type in target.op_types and id(consumer) not in self.used:
                tried = True
                if self.bind(st.node, consumer, i):
                    return True
        if not tried:
            return self.fail(st.node, lambda: f"no unmatched consumer of {var.name} has type "
                             f"{self.m.nodes[st.node].op_type_label}")
        return False

    def slot_var(self, node: int, slot: str, pos: int) -> Var | None:
        return slot_value(self.assign, node, slot, pos)

    def bind(self, n: int, op: Operation, i: int) -> bool:
        self.m.bind_attempts += 1
        node = self.m.nodes[n]
        if op.op_type not in node.op_types:
            return self.fail(n, lambda: f"op type differs at {node.name}: pattern wants "
                             f"{node.op_type_label}, program has {op.op_type} ({op.name})")
        if len(op.outputs) != node.num_outputs:
            return self.fail(n, lambda: f"{op.name} has {len(op.outputs)} outputs, pattern op "
                             f"{node.name} has {node.num_outputs}")
        if op.enclosing_block is not self.block:
            return self.fail(n, lambda: f"{op.name} lies in another block")
        if id(op) in self.used:
            return self.fail(n, lambda: f"{op.name} is already matched by another pattern op")
        if node.choice is not None:
            return self.bind_choice(n, op, i)
        for assignment in self.assignments(node, op):
            saved_roots = list(self.roots)
            if self.check_edges(node, op, assignment):
                self.ops[n] = op
                self.assign[n] = assignment
                self.used[id(op)] = n
                self.depth += 1
                if self.step(i + 1):
                    return True
                self.depth -= 1
                del self.used[id(op)]
                self.ops[n] = None
                self.assign[n] = None
            self.roots = saved_roots
        return False

    def bind_choice(self, n: int, op: Operation, i: int) -> bool:
        """Binds choice node ``n`` to ``op``: each complete match of each alternative ending at ``op``
        gives the node's slots; the search goes on with them (:mod:`pattern_infra.choices`)."""
        node = self.m.nodes[n]
        failures: list[str] | None = [] if self.trace else None
        tried = False
        for sub in choices.choice_matches(self.m, node.choice, op, self.block, failures, maximal=node.is_final):
            tried = True
            if self.bind_sub(n, op, sub, i):
                return True
        if not tried:
            return self.fail(n, lambda: f"tried {len(node.choice.alternatives)} alternatives for "
                             f"{node.name!r}: " + "; ".join(failures or []))
        return False

    def enter_choice(self, n: int, slot: str, var: Var, i: int) -> bool:
        """A down-step into choice node ``n`` through ``slot``, bound to ``var``: each alternative is
        searched from ``var`` (:func:`~pattern_infra.choices.entered_matches`), so only the ops below it
        that an alternative reaches are ever bound; each complete sub-match binds the node to its end op."""
        node = self.m.nodes[n]
        failures: list[str] | None = [] if self.trace else None
        tried = False
        for sub in choices.entered_matches(self.m, node.choice, slot, var, self.block, failures,
                                           maximal=node.is_final):
            tried = True
            if self.bind_sub(n, sub.end, sub, i):
                return True
        if not tried:
            return self.fail(n, lambda: f"tried {len(node.choice.alternatives)} alternatives for "
                             f"{node.name!r} from {var.name}: " + "; ".join(failures or []))
        return False

    def bind_sub(self, n: int, op: Operation, sub: choices.SubMatch, i: int) -> bool:
        """Binds choice node ``n`` to ``op`` with the sub-match ``sub`` and goes on with step ``i + 1``."""
        node = self.m.nodes[n]
        if any(id(o) in self.used for o in sub.ops):
            return self.fail(n, lambda: f"an op of alternative {sub.alternative} of {node.name!r} is already "
                             f"matched by another pattern op")
        saved_roots = list(self.roots)
        if self.check_edges(node, op, sub.slots):
            self.ops[n] = op
            self.assign[n] = sub.slots
            self.subs[n] = sub
            for o in sub.ops:
                self.used[id(o)] = n
            self.depth += 1
            if self.step(i + 1):
                return True
            self.depth -= 1
            for o in sub.ops:
                del self.used[id(o)]
            self.ops[n] = None
            self.assign[n] = None
            self.subs[n] = None
        self.roots = saved_roots
        return False

    def bind_fanout(self, n: int, var: Var, i: int) -> bool:
        """Binds node ``n`` to *all* consumers of ``var``; each must match the node on its own."""
        node = self.m.nodes[n]
        members = list(dict.fromkeys(var.child_ops))
        saved_roots = list(self.roots)
        assigned: list[dict[str, Any]] = []
        for op in members:
            self.m.bind_attempts += 1
            if op.op_type not in node.op_types or len(op.outputs) != node.num_outputs:
                self.roots = saved_roots
                return self.fail(n, lambda: f"fan-out {node.name}: consumer {op.name} of {var.name} is "
                                 f"{op.op_type}, not {node.op_type_label}")
            if op.enclosing_block is not self.block or id(op) in self.used:
                self.roots = saved_roots
                return self.fail(n, lambda: f"fan-out {node.name}: consumer {op.name} is outside the "
                                 f"block or already matched")
            ok = next((a for a in self.assignments(node, op) if self.check_edges(node, op, a)), None)
            if ok is None:
                self.roots = saved_roots
                return False
            assigned.append(ok)
        if not members:
            return self.fail(n, lambda: f"fan-out {node.name}: {var.name} has no consumer")
        self.ops[n] = members  # type: ignore[assignment]
        self.assign[n] = assigned[0]
        for op in members:
            self.used[id(op)] = n
        self.depth += 1
        if self.step(i + 1):
            return True
        self.depth -= 1
        for op in members:
            del self.used[id(op)]
        self.ops[n] = None
        self.assign[n] = None
        self.roots = saved_roots
        return False

    def assignments(self, node: PatternNode, op: Operation) -> Iterator[dict[str, Any]]:
        """Operand assignments to try: as written, then swapped for a commutative program op.

        A wildcard constant slot that an *alternative* op type lacks is left out (alternatives may
        differ in their attributes). Of the two orders of a commutative op, the one that puts
        compile-time constants in the pattern's constant slots is tried first.
        """
        values: dict[str, Any] = {}
        for slot, edge in node.inputs.items():
            value = input_value(op, slot)
            if value is None:
                if optional_const(self.m.compiled, edge) and op.op_type != node.op_type:
                    continue
                self.fail(node.index, lambda: f"{op.name} has no operand {slot!r}")
                return
            values[slot] = value
        swappable = node.commutative and (node.swap_any_type or op.op_type in COMMUTATIVE_OPS)
        if not swappable or values["x"] is values["y"]:
            yield values
            return
        swapped = dict(values)
        swapped["x"], swapped["y"] = values["y"], values["x"]
        orders = [values, swapped]
        if self._const_fit(node, swapped) > self._const_fit(node, values):
            orders.reverse()
        yield from orders

    def _const_fit(self, node: PatternNode, assignment: dict[str, Any]) -> int:
        """How many of x/y get a constant exactly where the pattern has a constant."""
        fit = 0
        for slot in ("x", "y"):
            edge = node.inputs[slot]
            is_const_slot = isinstance(edge, Edge) and edge.kind == "const"
            producer = assignment[slot].op
            fit += is_const_slot == (producer is not None and producer.op_type == "const")
        return fit

    def check_edges(self, node: PatternNode, op: Operation, assignment: dict[str, Any]) -> bool:
        for slot, edge in node.inputs.items():
            if slot not in assignment:
                continue  # a wildcard constant the alternative op type does not have
            value = assignment[slot]
            if isinstance(edge, tuple):
                if not isinstance(value, (list, tuple)) or len(value) != len(edge):
                    return self.fail(node.index, lambda: f"operand slot differs at {node.name}.{slot}: "
                                     f"pattern has {len(edge)} values")
                for pos, (e, v) in enumerate(zip(edge, value)):
                    if not self.check_edge(node, slot, e, v):
                        return False
            elif isinstance(value, (list, tuple)) or not self.check_edge(node, slot, edge, value):
                return False
        for consumer, slot, pos, out in node.consumers:
            if self.ops[consumer] is not None:
                var = self.slot_var(consumer, slot, pos)
                if var is not op.outputs[out]:
                    return self.fail(node.index, lambda: f"operand slot differs: "
                                     f"{self.m.nodes[consumer].name}.{slot} does not read {op.name}")
        return True

    def check_edge(self, node: PatternNode, slot: str, edge: Edge, var: Var) -> bool:
        if edge.kind == "root":
            bound = self.roots[edge.index]
            if bound is None:
                self.roots[edge.index] = var
                return True
            if bound is not var:
                return self.fail(node.index, lambda: f"operand slot differs at {node.name}.{slot}: "
                                 f"{var.name} where input {self.m.compiled.root_names[edge.index]!r} "
                                 f"is {bound.name}")
            return True
        if edge.kind == "const":
            _, expected, rule = self.m.compiled.consts[edge.index]
            if rule.mode == "any":
                return True
            reason = rule.accepts(var, expected)
            if reason is not None:
                return self.fail(node.index, f"constant differs at {node.name}.{slot}: {reason}")
            return True
        producer = self.ops[edge.index]
        if producer is not None and producer.outputs[edge.output] is not var:
            return self.fail(node.index, lambda: f"operand slot differs at {node.name}.{slot}: "
                             f"{var.name} is not the output of {producer.name}")
        return True

    def structure_ok(self) -> bool:
        """The checks of a complete binding (uses of intermediates, roots and constants not computed
        inside the match), before the match is built and offered to ``accept``."""
        for node in self.m.nodes:
            if node.is_final or node.fanout:
                continue
            op = self.ops[node.index]
            uses = list(node.output_uses)
            for consumer, _, _, out in node.consumers:
                members = self.ops[consumer]
                if isinstance(members, list):
                    uses[out] += len(members) - 1
            for j, var in enumerate(op.outputs):
                if var.consuming_blocks:
                    return self.fail(node.index, lambda: f"intermediate {var.name} of {node.name} is "
                                     f"a block output")
                if len(var.child_ops) != uses[j]:
                    return self.fail(node.index, lambda: f"extra consumer of intermediate {var.name} "
                                     f"({node.name}): used {len(var.child_ops)} times, the pattern "
                                     f"uses it {uses[j]} times")
        for r, var in enumerate(self.roots):
            if var is not None and var.op is not None and id(var.op) in self.used:
                return self.fail(0, lambda: f"input {self.m.compiled.root_names[r]!r} is bound to "
                                 f"{var.name}, which the match itself computes")
        for n, slot, pos in self.m.const_slots:
            var = self.slot_var(n, slot, pos)
            if var is not None and var.op is not None and id(var.op) in self.used:
                return self.fail(n, lambda: f"constant slot {self.m.nodes[n].name}.{slot} is wired "
                                 f"from inside the match ({var.name})")
        if self.m.has_choices and not choices.subs_final_ok(self.ops, self.subs):
            return self.fail(0, "a constant slot of an alternative is wired from inside the match")
        return True

    def final_checks(self) -> bool:
        if not self.structure_ok():
            return False
        pattern = build_pattern(self.m, self.block, self.ops, self.assign, self.roots, self.order, self.subs)
        if self.accept is not None:
            verdict = self.accept(pattern)
            if verdict is not True:
                last = self.m.compiled.final_nodes[-1]
                return self.fail(last, verdict if isinstance(verdict, str) else "the match was not taken")
        self.result = pattern
        return True


# -- design-document helpers, kept importable ---------------------------------------------------------

_COMPILED: dict[int, tuple[Any, CompiledPattern, Matcher]] = {}


Matcher.search_class = _Search
"""The interpreter's search class (the choices subclass it to collect every match)."""


def _pattern_function(root_var: Var) -> Any:
    for op in root_var.child_ops:
        return op.enclosing_block
    raise ValueError(f"pattern root variable {root_var.name} has no consumer")


def detect_pattern(program_op: Operation, ops_arrangement_root_var: Var, block: Block) -> tuple[bool, Pattern | None]:
    """Design-document entry point: is the pattern there, with ``program_op`` as its first op?

    Args:
        program_op: A program op, tried as the pattern's first op (the first consumer of its root).
        ops_arrangement_root_var: The root variable of the pattern program.
        block: The block to search.

    Returns:
        ``(True, pattern)`` on a match, else ``(False, None)``.
    """
    matcher = _function_matcher(_pattern_function(ops_arrangement_root_var))
    found = matcher.match_at(program_op, block, 0)
    return (True, found) if isinstance(found, Pattern) else (False, None)


def _function_matcher(function: Any) -> Matcher:
    cached = _COMPILED.get(id(function))
    if cached is None or cached[0] is not function:
        compiled = compile_pattern(_as_program(function))
        cached = (function, compiled, Matcher(compiled))
        _COMPILED[id(function)] = cached
    return cached[2]


def _as_program(function: Any) -> Any:
    from coremltools.converters.mil.mil import Program

    program = Program()
    program.functions["main"] = function
    return program


def pattern_detected(
    pattern: Pattern,
    program_op: Operation,
    pattern_op: Operation,
    program_root_var: Var,
    pattern_root_var: Var,
    block: Block,
) -> bool:
    """Design-document helper: does the pattern match with ``program_op`` standing for ``pattern_op``?

    On success the captured ops are added to ``pattern`` (``pattern.<name>``), with its root variable,
    block and final op.

    Args:
        pattern: The Pattern to fill.
        program_op: Program op placed at ``pattern_op``.
        pattern_op: An op of the pattern program.
        program_root_var: Program variable standing for the pattern's root.
        pattern_root_var: The pattern program's root variable.
        block: The block to search.

    Returns:
        Whether the whole pattern matched.
    """
    function = pattern_op.enclosing_block
    matcher = _function_matcher(function)
    anchor = matcher.compiled.by_name[pattern_op.name]
    found = matcher.match_at(program_op, block, anchor, root_hint=program_root_var)
    if not isinstance(found, Pattern):
        return False
    for name, op in found.ops.items():
        pattern.add_op(name, op)
    pattern.set_root_var(program_root_var)
    pattern.set_block(block)
    if found.final_op is not None:
        pattern.final_op = found.final_op
        pattern.final_ops = list(found.final_ops)
    return True


def lists_op_equality(oplist1: list[Operation], oplist2: list[Operation]) -> bool:
    """Design-document helper: same length and the same op types in the same order."""
    return len(oplist1) == len(oplist2) and all(
        a.op_type == b.op_type for a, b in zip(oplist1, oplist2)
    )
