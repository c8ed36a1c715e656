"""The search: one anchored, backtracking walk of a plan (:class:`Search`), the only search engine.

The algorithm is described in :mod:`~pattern_infra.matching.matcher`, which runs it; a choice node is
searched by :mod:`~pattern_infra.matching.choice_search`, which runs each alternative as a search of
its own (:meth:`Search.sub_search`) and hands each sub-match back to the rest of this one (``take``).
``explain`` runs the same search with ``trace=True``: a failure then records the nearest partial match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var

from . import choice_search
from ..language.graph import COMMUTATIVE_OPS, Alternative, Edge, PatternNode
from ..language.pattern import Pattern
from .binding import SubMatch, build_pattern
from .plan import UP, Accept, Failure, Step, enterable, input_value, optional_const, slot_value

__all__ = ["Search"]


class Search:
    """State of one anchored search; undone on backtracking."""

    __slots__ = ("m", "block", "plan", "trace", "ops", "assign", "roots", "used", "failure", "depth",
                 "order", "accept", "result", "subs", "take")

    def __init__(
        self,
        matcher: Any,
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
        self.subs: list[SubMatch | None] = [None] * n
        """Per pattern op, the sub-match of a choice node (None elsewhere)."""
        self.take: Callable[[Any], Any] | None = None
        """Set for an alternative's search (:meth:`sub_search`): called with each complete match's state
        instead of ``accept``; a truthy result ends the search."""

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
        if target.choice is not None and st.pos < 0 and enterable(target.choice, st.slot):
            return self.enter_choice(st.node, st.slot, var, i)
        candidates = (choice_search.candidates_below(var, target.choice) if target.choice is not None
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
        gives the node's slots, and the search goes on with them the moment it is found
        (:func:`~pattern_infra.matching.choice_search.choice_matches` calls :meth:`bind_sub` from inside the
        alternative's search: no alternative is searched further than the first match taken needs)."""
        node = self.m.nodes[n]
        failures: list[str] | None = [] if self.trace else None
        tried = []

        def take(sub: SubMatch) -> bool:
            tried.append(sub)
            return self.bind_sub(n, op, sub, i)

        if choice_search.choice_matches(self, node.choice, op, take, failures, maximal=node.is_final):
            return True
        if not tried:
            return self.fail(n, lambda: f"tried {len(node.choice.alternatives)} alternatives for "
                             f"{node.name!r}: " + "; ".join(failures or []))
        return False

    def enter_choice(self, n: int, slot: str, var: Var, i: int) -> bool:
        """A down-step into choice node ``n`` through ``slot``, bound to ``var``: each alternative is
        searched from ``var`` (:func:`~pattern_infra.matching.choice_search.entered_matches`), so only the ops below it
        that an alternative reaches are ever bound; each complete sub-match binds the node to its end op
        and the search goes on from it, as in :meth:`bind_choice`."""
        node = self.m.nodes[n]
        failures: list[str] | None = [] if self.trace else None
        tried = []

        def take(sub: SubMatch) -> bool:
            tried.append(sub)
            return self.bind_sub(n, sub.end, sub, i)

        if choice_search.entered_matches(self, node.choice, slot, var, take, failures, maximal=node.is_final):
            return True
        if not tried:
            return self.fail(n, lambda: f"tried {len(node.choice.alternatives)} alternatives for "
                             f"{node.name!r} from {var.name}: " + "; ".join(failures or []))
        return False

    def bind_sub(self, n: int, op: Operation, sub: SubMatch, i: int) -> bool:
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
        for n, slot, pos in self.m.compiled.const_slots:
            var = self.slot_var(n, slot, pos)
            if var is not None and var.op is not None and id(var.op) in self.used:
                return self.fail(n, lambda: f"constant slot {self.m.nodes[n].name}.{slot} is wired "
                                 f"from inside the match ({var.name})")
        if self.m.compiled.has_choices and not choice_search.subs_final_ok(self.ops, self.subs):
            return self.fail(0, "a constant slot of an alternative is wired from inside the match")
        return True

    def final_checks(self) -> bool:
        if not self.structure_ok():
            return False
        if self.take is not None:  # an alternative's search: the rest of the outer search decides
            self.result = self.take((list(self.ops), list(self.assign), list(self.roots), list(self.subs)))
            return bool(self.result)
        pattern = build_pattern(self.m.compiled, self.block, self.ops, self.assign, self.roots, self.order, self.subs)
        if self.accept is not None:
            verdict = self.accept(pattern)
            if verdict is not True:
                last = self.m.compiled.final_nodes[-1]
                return self.fail(last, verdict if isinstance(verdict, str) else "the match was not taken")
        self.result = pattern
        return True

    def sub_search(self, alternative: Alternative, trace: bool, take: Callable[[Any], Any],
                   op: Operation | None = None, entry: tuple[int, Var] | None = None) -> Search:
        """Searches ``alternative`` of a choice in this search's block, anchored at its last op bound to
        ``op`` or entered from ``entry`` (root index, variable), calling ``take`` with each complete
        match's state (a truthy result ends it, kept as ``.result``). Its bind attempts are counted in
        this search's matcher, but for those made while ``take`` runs (the rest of this search)."""
        matcher = self.m.alternative_matcher(alternative)
        plan = matcher.plans[alternative.compiled.final_nodes[0]] if entry is None else matcher.root_plans[entry[0]]
        search = Search(matcher, self.block, plan, trace)
        outer, before = self.m, matcher.bind_attempts

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
