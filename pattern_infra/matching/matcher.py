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

from coremltools.converters.mil.mil import Block, Operation, Var

from ..language.graph import Alternative, CompiledPattern, PatternNode
from ..language.pattern import Pattern
from .choice_search import all_op_types
from .plan import Accept, Failure, Step, entry_edge, parts_meet_only_at_inputs, plan, radii
from .search import Search

__all__ = ["Failure", "Matcher"]


class Matcher:
    """Searches one compiled pattern; stateless between calls except for counters and the alternatives' matchers."""

    def __init__(self, compiled: CompiledPattern) -> None:
        self.compiled = compiled
        self.nodes: list[PatternNode] = compiled.nodes
        self.plans: list[list[Step]] = [plan(compiled, a) for a in range(len(compiled.nodes))]
        self.root_plans: list[list[Step] | None] = [
            plan(compiled, entry[0], entry) if (entry := entry_edge(compiled, r)) is not None else None
            for r in range(len(compiled.root_names))
        ]
        """Per root: the search order of a search *entered* from that root's variable (for an alternative
        of a choice reached by a down-step, :func:`~pattern_infra.matching.choice_search.entered_matches`): a down-step
        to the root's first consumer, then the plan as from that op; None when no consumer can start it."""
        self.joins_through_roots: bool = parts_meet_only_at_inputs(compiled)
        """Whether some parts of the pattern are joined only through a pattern input they both read: in
        the program they may meet only at a variable shared widely (a deduplicated constant), which a
        revisit does not walk through, so the driver tries a changed op itself as each pattern op of its
        type. Otherwise every op of a match is reachable from any other through data edges."""
        self.radius: list[int] = radii(compiled, self.joins_through_roots)
        """Per anchor: producer/consumer hops from the anchor op within which any op of a match lies,
        plus one (an op just outside the match, such as a root's producer, can unblock it)."""
        self.op_types: frozenset[str] = all_op_types(compiled)
        """Every op type a match may contain (the alternatives' ops included)."""
        self.type_groups: tuple[tuple[str, ...], ...] = tuple(
            dict.fromkeys(tuple(sorted(n.op_types)) for n in compiled.nodes)
        )
        """The pattern ops' type sets, each once: a block can hold a match only if it has an op of
        every group."""
        self.anchors_by_type: dict[str, tuple[int, ...]] = {}
        """Program op type to the pattern ops (anchors) that accept it; fan-out ops excluded."""
        for node in compiled.nodes:
            if not node.fanout:
                for t in sorted(node.op_types):
                    self.anchors_by_type[t] = (*self.anchors_by_type.get(t, ()), node.index)
        self.attempts = 0
        """Anchor ops tried (across calls)."""
        self.bind_attempts = 0
        """Op bindings tried, anchors included (across calls): the matcher's unit of work."""
        self._alternatives: dict[int, Matcher] = {}

    # -- planning -----------------------------------------------------------------------------------

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

    def alternative_matcher(self, alternative: Alternative) -> Matcher:
        """The matcher of an alternative of one of this pattern's choices, built on first use."""
        matcher = self._alternatives.get(id(alternative))
        if matcher is None:
            matcher = self._alternatives[id(alternative)] = Matcher(alternative.compiled)
        return matcher


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
