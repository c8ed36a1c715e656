"""The search: one anchored, backtracking walk of a plan tree (:class:`Search`), the only search engine.

The tree (:class:`~.plan.Branch`, built by :mod:`~pattern_infra.matching.matcher`) holds the
spellings' plans merged. The walk, from the anchor op:

1. **A step** reaches one pattern op: *up* (the producer of a slot of an op bound: one candidate) or
   *down* (each consumer of a variable bound, of an accepted type, not bound yet).
2. **Binding an op** checks, before any recursion: op type, number of outputs, same block, not bound yet
   (a match is injective); then each operand order the op allows (two for a commutative op); then every
   data edge whose both ends are bound: inputs bound consistently, constants satisfying their rule,
   producers and consumers the very same variables. Then the branch's next steps, in order.
3. **Backtracking** truncates the trail, the list of bindings (ops with their operand orders, inputs)
   in the order made, to where the failed branch began.
4. **A leaf** is a complete spelling (:class:`~.plan.Leaf`): outputs of non-final ops have exactly the
   pattern's uses and are not block outputs; no input and no constant slot is computed inside the match;
   the longest-spelling guards hold. Then ``accept`` (the user's constraints, the transform) decides:
   anything but ``True`` backtracks, and the walk goes on to the next match at the same anchor.

Cost per anchor candidate: an up-step is O(1), a down-step O(consumers of one variable), so a pattern of
up-steps costs O(pattern size); a choice costs a branch, not a copy of what comes before it; the consumers
of a variable are never permuted (each pattern op picks one at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var
from coremltools.converters.mil.mil.var import InternalVar

from ..language.graph import COMMUTATIVE_OPS, Edge, PatternNode
from ..language.pattern import Order, Pattern
from .plan import UP, Accept, Branch, Failure, Leaf, PassStats, Step

__all__ = ["Binding", "Search"]

Binding = tuple[int, Any, "dict[str, Any] | None", int]
"""One entry of the search's trail (:attr:`Search.trail`)."""


class Search:
    """State of one anchored walk: the trail, undone on backtracking."""

    def __init__(
        self,
        matcher: Any,
        block: Block,
        stats: PassStats,
        trace: bool,
        order: Order | None = None,
        accept: Accept | None = None,
    ) -> None:
        self.m = matcher  # the Matcher: its ops, constants, spellings and plan trees
        self.block = block
        self.stats = stats  # counts the bindings tried
        self.trace = trace
        self.trail: list[Binding] = []
        """Every binding in the order made: ``(place, op, operands, node)`` for pattern op ``node`` (of
        ``Matcher.ops``) bound at a place of the search state to ``op`` (a list for a fan-out op) with its
        operands as assigned (after any swap); ``(~r, var, None, -1)`` for pattern input ``r``. A
        backtrack truncates it to where the failed branch began (:meth:`undo`)."""
        self.at: list[Binding | None] = [None] * len(matcher.places)
        """Per place, its binding on the trail (None while unbound)."""
        self.roots: list[Var | None] = [None] * len(matcher.compiled.root_names)
        """Per pattern input (by position), the program variable bound (the trail's input bindings)."""
        self.used: set[int] = set()
        """The program ops bound (by id): a match is injective."""
        self.failure: Failure | None = None
        self.order = order
        self.accept = accept
        self.result: Pattern | None = None  # the match taken, once the search succeeded

    def undo(self, mark: int) -> None:
        """Truncates the trail to its first ``mark`` bindings, unbinding the others."""
        trail = self.trail
        for place, op, _, node in trail[mark:]:
            if node < 0:
                self.roots[~place] = None
                continue
            self.at[place] = None
            for member in op if type(op) is list else (op,):
                self.used.discard(id(member))
        del trail[mark:]

    def fail(self, node: int, reason: str | Callable[..., str], *args: Any) -> bool:
        """Returns False; when tracing (``explain``), keeps the failure (``reason``, or ``reason(*args)``) if
        more ops are bound than at the deepest so far."""
        if not self.trace:
            return False
        bound = sorted(entry for entry in self.trail if entry[3] >= 0)  # by place: one op each
        if self.failure is None or len(bound) > self.failure.bound:
            within = self.m.within[node]
            self.failure = Failure(
                bound=len(bound),
                node=self.m.ops[node].name,
                reason=(reason(*args) if callable(reason) else reason)
                + (f" (alternative {within[1]} of {within[0]!r})" if within else ""),
                ops={
                    self.m.ops[n].name: f"[{', '.join(x.name for x in o)}]" if isinstance(o, list) else o.name
                    for _, o, _, n in bound
                },
            )
        return False

    def run(self, anchor_op: Operation, tree: list[Branch]) -> bool:
        return any(self.bind(branch.step.node, anchor_op, branch) for branch in tree)

    def next(self, branch: Branch) -> bool:
        for item in branch.then:
            if self.leaf(item) if type(item) is Leaf else self.step(item):  # type: ignore[arg-type]
                return True
        return False

    def step(self, branch: Branch) -> bool:
        st = branch.step
        if st.kind == UP:
            src = self.at[st.src]  # an op's place: bound before this step, with its operands
            var = slot_value(src[2], st.slot, st.pos)  # type: ignore[index, arg-type]
            producer = var.op if var is not None else None
            if producer is None or st.out >= len(producer.outputs) or producer.outputs[st.out] is not var:
                return self.fail(st.node, self.unproduced, st, src, producer)
            return self.bind(st.node, producer, branch)
        if st.src_kind == "root":
            var = self.roots[st.src]
        else:
            src = self.at[st.src]
            var = src[1].outputs[st.out] if src is not None else None
        if var is None:
            return False
        target = self.m.ops[st.node]
        if target.fanout:
            return self.bind_fanout(st.node, var, branch)
        tried = False
        for consumer in dict.fromkeys(var.child_ops):
            if consumer.op_type in target.op_types and id(consumer) not in self.used:
                tried = True
                if self.bind(st.node, consumer, branch):
                    return True
        if not tried:
            return self.fail(
                st.node, lambda: f"no unmatched consumer of {var.name} has type {target.op_type_label}"
            )
        return False

    def bind(self, n: int, op: Operation, branch: Branch) -> bool:
        node = self.m.ops[n]
        if op.op_type not in node.op_types:
            return self.fail(n, self.refusal, node, op)
        self.stats.bind_attempts += 1
        if len(op.outputs) != node.num_outputs or op.enclosing_block is not self.block or id(op) in self.used:
            return self.fail(n, self.refusal, node, op)
        mark, place = len(self.trail), self.m.place[n]
        for assignment in self.assignments(node, op):
            if self.check_edges(node, op, assignment):
                binding = (place, op, assignment, n)  # onto the trail, inline: the search's hottest path
                self.trail.append(binding)
                self.at[place] = binding
                self.used.add(id(op))
                if self.next(branch):
                    return True
            self.undo(mark)
        return False

    def bind_fanout(self, n: int, var: Var, branch: Branch) -> bool:
        """Binds op ``n`` to *all* consumers of ``var``; each must match the op on its own."""
        node = self.m.ops[n]
        members = list(dict.fromkeys(var.child_ops))
        mark = len(self.trail)
        assigned: list[dict[str, Any]] = []
        for op in members:
            self.stats.bind_attempts += 1
            if (
                op.op_type not in node.op_types
                or len(op.outputs) != node.num_outputs
                or op.enclosing_block is not self.block
                or id(op) in self.used
            ):
                self.undo(mark)
                return self.fail(n, self.refusal, node, op, var)
            ok = next((a for a in self.assignments(node, op) if self.check_edges(node, op, a)), None)
            if ok is None:
                self.undo(mark)
                return False
            assigned.append(ok)
        if not members:
            return self.fail(n, lambda: f"fan-out {node.name}: {var.name} has no consumer")
        binding = (self.m.place[n], members, assigned[0], n)
        self.trail.append(binding)
        self.at[binding[0]] = binding
        self.used.update(map(id, members))
        if self.next(branch):
            return True
        self.undo(mark)
        return False

    def refusal(self, node: PatternNode, op: Operation, var: Var | None = None) -> str:
        """Why ``op`` cannot be bound to ``node`` (as a fan-out op's consumer of ``var``, if given)."""
        if op.op_type not in node.op_types:
            wants = f"pattern wants {node.op_type_label}, program has {op.op_type} ({op.name})"
            why = f"op type differs at {node.name}: {wants}"
        elif len(op.outputs) != node.num_outputs:
            why = f"{op.name} has {len(op.outputs)} outputs, pattern op {node.name} has {node.num_outputs}"
        elif op.enclosing_block is not self.block:
            why = f"{op.name} lies in another block"
        else:
            why = f"{op.name} is already matched by another pattern op"
        return why if var is None else f"fan-out {node.name}, consumer of {var.name}: {why}"

    def unproduced(self, st: Step, src: Binding, producer: Operation | None) -> str:
        """Why the operand an up-step follows is no output ``st.out`` of an op (``producer``, if any)."""
        what = f"not output {st.out} of {producer.name}" if producer else "a graph input, not an op's output"
        return f"operand {st.slot} of {self.m.ops[src[3]].name} is {what}"

    def assignments(self, node: PatternNode, op: Operation) -> Iterator[dict[str, Any]]:
        """Operand assignments to try: as written, then swapped for a commutative op (first the order putting
        constants in the pattern's constant slots); a wildcard constant slot an alternative op type lacks is
        left out."""
        values: dict[str, Any] = {}
        read = op._input_vars  # read-only use of the private map: op.inputs copies it
        for slot, edge in node.inputs.items():
            value = read.get(slot)
            if value is None or isinstance(value, InternalVar):
                wildcard = (
                    type(edge) is Edge and edge.kind == "const" and self.m.consts[edge.index][2].mode == "any"
                )
                if wildcard and op.op_type != node.op_type:
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
        if _const_fit(node, swapped) > _const_fit(node, values):
            orders.reverse()
        yield from orders

    def check_edges(self, node: PatternNode, op: Operation, assignment: dict[str, Any]) -> bool:
        for slot, edge in node.inputs.items():
            if slot not in assignment:
                continue  # a wildcard constant the alternative op type does not have
            value = assignment[slot]
            if isinstance(edge, tuple):
                if not isinstance(value, (list, tuple)) or len(value) != len(edge):
                    return self.fail(
                        node.index,
                        lambda: f"operand slot differs at {node.name}.{slot}: pattern has {len(edge)} values",
                    )
                for e, v in zip(edge, value):
                    if not self.check_edge(node, slot, e, v):
                        return False
            elif isinstance(value, (list, tuple)) or not self.check_edge(node, slot, edge, value):
                return False
        for consumer, slot, pos, out in node.consumers:
            bound = self.at[self.m.place[consumer]]
            if bound is not None and bound[3] == consumer:
                var = slot_value(bound[2], slot, pos)
                if var is not op.outputs[out]:
                    return self.fail(
                        node.index,
                        lambda: (
                            f"operand slot differs: "
                            f"{self.m.ops[consumer].name}.{slot} does not read {op.name}"
                        ),
                    )
        return True

    def check_edge(self, node: PatternNode, slot: str, edge: Edge, var: Var) -> bool:
        if edge.kind == "root":
            bound = self.roots[edge.index]
            if bound is None:
                self.roots[edge.index] = var
                self.trail.append((~edge.index, var, None, -1))
            elif bound is not var:
                return self.fail(
                    node.index,
                    lambda: (
                        f"operand slot differs at {node.name}.{slot}: "
                        f"{var.name} where input {self.m.compiled.root_names[edge.index]!r} "
                        f"is {bound.name}"
                    ),
                )
        elif edge.kind == "const":
            _, expected, rule = self.m.consts[edge.index]
            reason = None if rule.mode == "any" else rule.accepts(var, expected)
            if reason is not None:
                return self.fail(node.index, f"constant differs at {node.name}.{slot}: {reason}")
        else:
            producer = self.at[edge.index]
            if producer is not None and producer[1].outputs[edge.output] is not var:
                return self.fail(
                    node.index,
                    lambda: (
                        f"operand slot differs at {node.name}.{slot}: "
                        f"{var.name} is not the output of {producer[1].name}"
                    ),
                )
        return True

    def leaf(self, leaf: Leaf) -> bool:
        """A complete spelling: its final checks, its guards, then ``accept`` offered its :class:`Pattern`
        (the ops by name, a choice's by the choice's too; the operands after any swap; the constants)."""
        variant = self.m.variants[leaf.variant]
        compiled, index = variant.compiled, self.m.index[leaf.variant]
        bound = [self.at[p] for p in self.m.state[leaf.variant]]
        ops, assign = [b[1] for b in bound], [b[2] for b in bound]
        if not self.structure_ok(compiled, index, ops, assign):
            return False
        for guard in leaf.guards:
            end = compiled.by_name[guard.end]
            if self.m.taken_further(guard, ops[end], self.block, self.stats):
                return self.fail(
                    index[end], f"an earlier alternative of {guard.choice!r} matches further down"
                )
        by_name: dict[str, Any] = {}
        operands: dict[str, dict[str, Any]] = {}
        for name, op, slots in zip(compiled.node_names, ops, assign):
            by_name[name] = op
            operands[name] = dict(slots)
            for choice in variant.aliases.get(name, ()):  # pattern.<choice>: the op computing its variable
                by_name[choice] = op
        consts: dict[str, Var] = {}
        for (n, slot, pos), key, cname in zip(
            compiled.const_slots, compiled.const_keys, compiled.const_names
        ):
            var = slot_value(assign[n], slot, pos)
            if var is not None:  # absent: a wildcard slot the matched alternative op type does not have
                consts[key] = var
                consts.setdefault(cname, var)
        roots = self.roots[: len(compiled.root_names)]  # its program's (those of a list may have more inputs)
        pattern = Pattern(compiled, self.block, by_name, roots, operands, consts, self.order, variant.choices)
        if self.accept is not None:
            verdict = self.accept(pattern)
            if verdict is not True:
                last = index[compiled.final_nodes[-1]]
                return self.fail(last, verdict if isinstance(verdict, str) else "the match was not taken")
        self.result = pattern
        return True

    def structure_ok(self, compiled: Any, index: list[int], ops: list[Any], assign: list[Any]) -> bool:
        """A complete binding's checks: uses of intermediates, no input or constant computed inside the
        match."""
        for node in compiled.nodes:
            if node.is_final or node.fanout:
                continue
            op = ops[node.index]
            uses = list(node.output_uses)
            for consumer, _, _, out in node.consumers:
                if isinstance(ops[consumer], list):
                    uses[out] += len(ops[consumer]) - 1
            for j, var in enumerate(op.outputs):
                if var.consuming_blocks:
                    return self.fail(
                        index[node.index], lambda: f"intermediate {var.name} of {node.name} is a block output"
                    )
                if len(var.child_ops) != uses[j]:
                    return self.fail(
                        index[node.index],
                        lambda: (
                            f"extra consumer of intermediate {var.name} "
                            f"({node.name}): used {len(var.child_ops)} times, the pattern uses it "
                            f"{uses[j]} times"
                        ),
                    )
        for r, var in enumerate(self.roots):
            if var is not None and var.op is not None and id(var.op) in self.used:
                return self.fail(
                    index[0],
                    lambda: (
                        f"input {compiled.root_names[r]!r} is bound to {var.name}, "
                        f"which the match itself computes"
                    ),
                )
        for n, slot, pos in compiled.const_slots:
            var = slot_value(assign[n], slot, pos)
            if var is not None and var.op is not None and id(var.op) in self.used:
                return self.fail(
                    index[n],
                    lambda: (
                        f"constant slot {compiled.nodes[n].name}.{slot} is wired "
                        f"from inside the match ({var.name})"
                    ),
                )
        return True


def _const_fit(node: PatternNode, assignment: dict[str, Any]) -> int:
    """How many of x/y get a constant exactly where the pattern has a constant."""
    fit = 0
    for slot in ("x", "y"):
        edge = node.inputs[slot]
        is_const_slot = isinstance(edge, Edge) and edge.kind == "const"
        producer = assignment[slot].op
        fit += is_const_slot == (producer is not None and producer.op_type == "const")
    return fit


def slot_value(assigned: dict[str, Any], slot: str, pos: int) -> Any:
    """The variable at ``slot`` (at ``pos`` of a list operand, unless ``pos`` is -1) of an op's operands."""
    value = assigned.get(slot)
    if pos >= 0:
        return value[pos] if isinstance(value, (list, tuple)) and pos < len(value) else None
    return value
