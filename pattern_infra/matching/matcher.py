"""A pattern's plan trees: its spellings' ops merged into places, the anchors every spelling has, and per
anchor the spellings' plans (:func:`~.plan.plan`) merged into one tree (:class:`~.plan.Branch`), so the
steps they share come once; :class:`~.search.Search` walks it. The driver anchors at the anchor whose op
types are rarest in the block (docs/ARCHITECTURE.md, "Alternatives: expanded when a pattern compiles")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from coremltools.converters.mil.mil import Block, Operation, Var

from ..language.errors import PatternDefinitionError
from ..language.graph import CompiledPattern, Edge, PatternNode, distances
from ..language.pattern import Order, Pattern
from ..language.variants import Guard, Variant
from .plan import DOWN, Accept, Branch, Failure, Leaf, PassStats, plan
from .search import Search

__all__ = ["Anchor", "Failure", "Matcher", "candidates_below"]


@dataclass(frozen=True)
class Anchor:
    """A pattern op every spelling has outside its choices, or a choice (its alternatives' last ops): a
    place the search may start from."""

    index: int
    name: str
    op_types: frozenset[str]
    """The op types the spellings have there."""
    fanout: bool


class Matcher:
    """Searches one compiled pattern; stateless between calls but for its counters."""

    def __init__(self, compiled: CompiledPattern) -> None:
        self.compiled = compiled
        self.variants: list[Variant] = compiled.variants
        """The pattern's spellings, each a plain pattern."""
        self.program = [p for p, part in enumerate(compiled.parts or [compiled]) for _ in part.variants]
        """Per spelling, the program it comes from (of several, :attr:`CompiledPattern.parts`)."""
        self.ops: list[PatternNode] = []
        """Every distinct op of every spelling, once: the plan trees' ops; their edges index it and
        :attr:`consts`."""
        self.consts: list[tuple[str, Any, Any]] = []
        """Every constant use of every spelling, each distinct one once."""
        self.place: list[int] = []
        """Per op of :attr:`ops`, its place in the search state (:attr:`places`)."""
        self.within: list[tuple[str, str] | None] = []
        """Per op of :attr:`ops`, the innermost choice it belongs to and its alternative, in words."""
        self._keys: dict[tuple[Any, ...], int] = {}
        self._const_keys: dict[tuple[Any, ...], int] = {}
        self._places: dict[str, int] = {}
        self.index: list[list[int]] = [self._merge(v) for v in range(len(self.variants))]
        """Per spelling, its ops' indices in :attr:`ops`."""
        self.places: list[str] = list(self._places)
        """The search state's places: an op's name, or the choice whose variable it computes."""
        self.state: list[list[int]] = [[self.place[i] for i in index] for index in self.index]
        """Per spelling, its ops' places in the search state."""
        self.nodes: list[Anchor] = self._anchors()
        """The anchors, in the first spelling's order."""
        self.joins_through_roots: bool = any(
            len(distances(v.compiled.hops(False), 0)) < len(v.compiled.nodes) for v in self.variants
        )
        """Whether parts of the pattern meet only at a pattern input they both read: in the program maybe a
        widely shared constant, which a revisit does not walk through, so the driver also tries a changed op
        as each pattern op of its type."""
        hops = [v.compiled.hops(self.joins_through_roots) for v in self.variants]
        self.radius: list[int] = [
            1 + max(max(distances(hops[v], self._local(v, a.name)).values()) for v in range(len(hops)))
            for a in self.nodes
        ]
        """Per anchor: producer/consumer hops from the anchor op within which any op of a match lies, plus
        one (an op just outside the match, such as a root's producer, can unblock it)."""
        self.trees: list[list[Branch]] = [self._tree(a) for a in self.nodes]
        """Per anchor, the spellings' plans merged into one tree."""
        self.op_types: frozenset[str] = frozenset(t for node in self.ops for t in node.op_types)
        """Every op type a match may contain."""
        self.type_groups: tuple[tuple[str, ...], ...] = tuple(
            dict.fromkeys(tuple(sorted(a.op_types)) for a in self.nodes)
        )
        """The anchors' type sets, each once: a block can hold a match only if it has an op of every group."""
        self.anchors_by_type: dict[str, tuple[int, ...]] = {}
        """Program op type to the anchors that accept it; fan-out ops excluded."""
        for anchor in self.nodes:
            if not anchor.fanout:
                for t in sorted(anchor.op_types):
                    self.anchors_by_type[t] = (*self.anchors_by_type.get(t, ()), anchor.index)
        self.stats = PassStats()
        """The counters of the searches handed none (outside a pass: ``find_matches``, ``explain``)."""
        self._alternatives: dict[int, Matcher] = {}

    # -- the plan trees ------------------------------------------------------------------------------

    def _merge(self, v: int) -> list[int]:
        """Adds the ops of spelling ``v`` to :attr:`ops` (those not there yet); returns their places."""
        variant = self.variants[v]
        spelling = variant.compiled
        index: list[int] = []
        consts: dict[int, int] = {}
        for e, (key, value, rule) in enumerate(spelling.consts):
            entry = (key, None if value is None else (value.dtype.str, value.shape, value.tobytes()), rule)
            consts[e] = self._const_keys.setdefault(entry, len(self._const_keys))
            if consts[e] == len(self.consts):
                self.consts.append((key, value, rule))
        # an op's place in the search state: its name, or for the op computing a choice's variable the
        # outermost such choice's (the ops a choice's alternatives end with share it)
        names = [variant.aliases.get(node.name, (node.name,))[-1] for node in spelling.nodes]
        places = [self._places.setdefault(name, len(self._places)) for name in names]

        def moved(edge: Edge) -> Edge:
            if edge.kind == "op":
                return Edge("op", places[edge.index], edge.output)
            return Edge("const", consts[edge.index]) if edge.kind == "const" else edge

        for node in spelling.nodes:
            inputs = {
                slot: tuple(map(moved, edge)) if isinstance(edge, tuple) else moved(edge)
                for slot, edge in node.inputs.items()
            }
            node_key = (
                places[node.index],
                node.name,
                node.op_types,
                node.num_outputs,
                tuple(inputs.items()),
                node.commutative,
                node.swap_any_type,
                node.fanout,
            )
            found = self._keys.setdefault(node_key, len(self._keys))
            if found == len(self.ops):
                self.ops.append(replace(node, index=found, inputs=inputs, consumers=[]))  # consumers: below
                self.place.append(places[node.index])
                self.within.append(variant.within.get(node.name))
            index.append(found)
        for node in spelling.nodes:  # the consumers an op's binding checks when they are bound before it
            for consumer, slot, pos, out in node.consumers:
                consumer_entry = (index[consumer], slot, pos, out)
                if consumer_entry not in self.ops[index[node.index]].consumers:
                    self.ops[index[node.index]].consumers.append(consumer_entry)
        return index

    def _anchors(self) -> list[Anchor]:
        """The places every spelling has, outside its choices or as a choice's variable."""
        names = [self.places[p] for p in self.state[0]]
        for v, variant in enumerate(self.variants):
            held = {self.places[p] for p in self.state[v]}
            names = [
                n
                for n in names
                if n in held
                and (n in variant.groups.values() or (n not in variant.groups and n not in variant.choices))
            ]
        if not names:
            raise PatternDefinitionError(
                f"Pattern {self.compiled.name!r}: its programs have no op name in common outside their "
                "choices, where a search could start. Name the ops that correspond alike in each program."
            )
        anchors: list[Anchor] = []
        for i, name in enumerate(names):
            ops = [self.ops[self.index[v][self._local(v, name)]] for v in range(len(self.variants))]
            anchors.append(Anchor(i, name, frozenset(t for op in ops for t in op.op_types), ops[0].fanout))
        return anchors

    def _local(self, v: int, place: str) -> int:
        """The node of spelling ``v`` at ``place``."""
        return self.state[v].index(self._places[place])

    def _tree(self, anchor: Anchor) -> list[Branch]:
        """The spellings' plans anchored at ``anchor``, merged: a spelling joins the last branch of each
        level while its steps are the same, so the walk meets the spellings in order."""
        firsts = {p: self.program.index(p) for p in dict.fromkeys(self.program)}  # per program
        choices = {p: self._choices_met(v, anchor.name) for p, v in firsts.items()}
        ranked = sorted(
            range(len(self.variants)),
            key=lambda v: (self.program[v], _order(self.variants[v], choices[self.program[v]])),
        )
        roots: list[Branch | Leaf] = []
        for v in ranked:
            variant, index = self.variants[v], self.index[v]
            # the anchor's own choice first, then the ops outside choices, then the choices as met
            level_of = {anchor.name: -1} | {c: 1 + i for i, c in enumerate(choices[self.program[v]])}
            rank = [level_of.get(variant.groups.get(n.name, ""), 0) for n in variant.compiled.nodes]
            steps = plan(variant.compiled, self._local(v, anchor.name), rank)
            downs = {st.node for st in steps if st.kind == DOWN}
            guards = tuple(
                g for g in variant.guards if not (g.fallback and variant.compiled.by_name[g.end] in downs)
            )
            level = roots
            for st in steps:
                # the spelling's step on the merged ops: its node by op index, an op source by place
                moved = replace(
                    st, node=index[st.node], src=self.place[index[st.src]] if st.src_kind == "op" else st.src
                )
                if not (level and type(level[-1]) is Branch and level[-1].step == moved):
                    level.append(Branch(moved))
                level = level[-1].then  # type: ignore[union-attr]  # a Branch: the one matched or appended
            level.append(Leaf(v, guards))
        return cast(list[Branch], roots)  # every plan starts with the anchor's own step: no leaf at the root

    def _choices_met(self, v: int, anchor: str) -> list[str]:
        """The choices of spelling ``v`` in the order its plan from ``anchor`` meets them."""
        variant = self.variants[v]
        nodes, groups = variant.compiled.nodes, variant.groups
        steps = plan(variant.compiled, self._local(v, anchor), [int(n.name in groups) for n in nodes])
        met = dict.fromkeys(groups[nodes[st.node].name] for st in steps if nodes[st.node].name in groups)
        return [c for c in met if c != anchor]

    def choose_anchor(self, type_counts: Mapping[str, int]) -> int:
        """The anchor whose accepted types are rarest among ``type_counts``; ties go to the last."""
        anchors = [a for a in reversed(self.nodes) if not a.fanout]
        return (
            min(anchors, key=lambda a: sum(type_counts.get(t, 0) for t in a.op_types)).index if anchors else 0
        )

    def taken_further(self, guard: Guard, op: Operation, block: Block, stats: PassStats) -> bool:
        """Whether an alternative of ``guard.choice`` before the one taken matches at an op below ``op``
        with ``op`` inside (the longest spelling wins)."""
        for below in candidates_below(op.outputs[0], guard.depth, guard.output_types):
            for earlier in guard.earlier:
                matcher = self._alternatives.get(id(earlier)) or Matcher(earlier)  # built on first use
                self._alternatives[id(earlier)] = matcher
                end = len(matcher.nodes) - 1  # the anchor of its output: an alternative's last op is its last
                if below.op_type not in matcher.nodes[end].op_types:
                    continue
                found = matcher.match_at(below, block, end, accept=lambda p: op in p.op_set, stats=stats)
                if found is not None:
                    return True
        return False

    def match_at(
        self,
        op: Operation,
        block: Block,
        anchor: int,
        *,
        order: Order | None = None,
        trace: bool = False,
        accept: Accept | None = None,
        stats: PassStats | None = None,
    ) -> Pattern | Failure | None:
        """Tries to match with ``op`` bound to pattern op number ``anchor``, the whole match in ``block``.

        Args:
            order: Sorts captured ops into program order for ``Pattern.op_list``.
            trace: Return a :class:`Failure` describing the nearest miss instead of None.
            accept: Offered each complete structural match in search order: ``True`` takes it, anything else
                lets the search go on (a string is the reason a tracing search reports). None takes the first.
            stats: Counts the bindings tried (default: :attr:`stats`).

        Returns:
            A :class:`Pattern` on success; on failure None, or a :class:`Failure` when tracing.
        """
        search = Search(self, block, self.stats if stats is None else stats, trace, order, accept)
        if search.run(op, self.trees[anchor]):
            return search.result
        return search.failure if trace else None


def candidates_below(var: Var, depth: int, op_types: frozenset[str]) -> list[Operation]:
    """Ops of ``op_types`` at most ``depth`` consumer steps below ``var``, breadth first, each once."""
    seen: dict[int, Operation] = {}  # every op reached, in the order reached
    frontier = [var]
    for _ in range(depth):
        next_vars: list[Var] = []
        for v in frontier:
            for op in v.child_ops:
                if id(op) not in seen:
                    seen[id(op)] = op
                    next_vars.extend(op.outputs)
        frontier = next_vars
    return [op for op in seen.values() if op.op_type in op_types]


def _order(variant: Variant, choices: list[str]) -> tuple[int, ...]:
    """Where a spelling comes among the others from an anchor: by the alternatives its choices took, in
    the order the plan meets the choices (nested choices right after their own)."""
    taken = list(variant.choices.items())
    key: list[int] = []
    for choice in choices:
        start = next(i for i, (name, _) in enumerate(taken) if name == choice)
        key.append(taken[start][1])
        for name, k in taken[start + 1 :]:
            if name in choices:
                break
            key.append(k)
    return tuple(key)
