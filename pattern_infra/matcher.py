"""Find a compiled pattern in a block: anchored, typed, backtracking search.

Algorithm (per pattern, per block):

1. **Plans, once per pattern.** For every pattern op taken as the *anchor*, a search order is computed
   at registration: starting from the anchor, each further op is reached either *up* (the producer of an
   input slot of an op already placed: a single candidate) or *down* (a consumer of a variable already
   bound: one candidate per consumer of the right type). Up-steps are preferred; down-steps are only
   needed for patterns with several outputs or ops joined through an input. Choice nodes come last, so
   a search failing on the plain ops never searches the alternatives.
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

Cost: for an anchor candidate, each up-step is O(1) and each down-step O(consumers of one variable),
so a pattern with only up-steps costs O(pattern size) per anchor op; the consumers of a variable are
never permuted (no k! enumeration) because each pattern op picks one consumer at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Var

from . import choice_search
from .compiler import CompiledPattern, PatternNode, compile_pattern, edge_positions
from .interpreter import Search
from .pattern import Pattern
from .plan import DOWN, UP, Accept, Failure, Step

__all__ = [
    "Failure",
    "Matcher",
    "detect_pattern",
    "pattern_detected",
    "lists_op_equality",
]


class Matcher:
    """Searches one compiled pattern; stateless between calls except for counters and compiled searches."""

    def __init__(self, compiled: CompiledPattern) -> None:
        self.compiled = compiled
        self.nodes: list[PatternNode] = compiled.nodes
        self.plans: list[list[Step]] = [self._plan(a) for a in range(len(compiled.nodes))]
        self.root_plans: list[list[Step] | None] = [
            self._plan(entry[0], entry) if (entry := choice_search.entry_edge(compiled, r)) is not None else None
            for r in range(len(compiled.root_names))
        ]
        """Per root: the search order of a search *entered* from that root's variable (for an alternative
        of a choice reached by a down-step, :func:`~pattern_infra.choice_search.entered_matches`): a down-step
        to the root's first consumer, then the plan as from that op; None when no consumer can start it."""
        self.joins_through_roots: bool = _parts_meet_only_at_inputs(compiled)
        """Whether some parts of the pattern are joined only through a pattern input they both read: in
        the program they may meet only at a variable shared widely (a deduplicated constant), which a
        revisit does not walk through, so the driver tries a changed op itself as each pattern op of its
        type. Otherwise every op of a match is reachable from any other through data edges."""
        self.radius: list[int] = self._radii()
        """Per anchor: producer/consumer hops from the anchor op within which any op of a match lies,
        plus one (an op just outside the match, such as a root's producer, can unblock it)."""
        self.op_types: frozenset[str] = choice_search.all_op_types(compiled)
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
        while len(placed) < len(nodes):  # choice nodes last: a search that fails elsewhere never tries them
            step = (self._next_up(placed, plain=True) or self._next_down(placed, roots_bound, plain=True)
                    or self._next_up(placed) or self._next_down(placed, roots_bound))
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

    def _next_up(self, placed: set[int], plain: bool = False) -> Step | None:
        for n in sorted(placed):
            for slot, edge in self.nodes[n].inputs.items():
                for pos, e in edge_positions(edge):
                    if e.kind == "op" and e.index not in placed and not (plain and self.nodes[e.index].choice):
                        return Step(UP, e.index, "op", n, slot, pos, e.output)
        return None

    def _next_down(self, placed: set[int], roots_bound: set[int], plain: bool = False) -> Step | None:
        best: tuple[int, int, Step] | None = None
        for m, node in enumerate(self.nodes):
            if m in placed or (plain and node.choice is not None):
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
        search = Search(self, block, self.plans[anchor], trace, order, accept)
        if root_hint is not None:
            search.roots[0] = root_hint
        if search.run(op):
            return search.result
        return search.failure if trace else None


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


Matcher.search_class = Search
"""The interpreter's search class (the choices subclass it to collect every match)."""


# -- design-document helpers, kept importable ---------------------------------------------------------

_COMPILED: dict[int, tuple[Any, CompiledPattern, Matcher]] = {}


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
