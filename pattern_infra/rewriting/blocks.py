"""The blocks of a program, and an index of each block's ops by type kept current while a pass runs,
with the one anchor loop (:meth:`BlockIndex.tries`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program, Var
from coremltools.converters.mil.mil.var import InternalVar

from ..matching.matcher import Matcher
from ..matching.plan import PassStats

__all__ = ["BlockIndex", "flat_inputs", "walk_blocks"]


def flat_inputs(op: Operation) -> list[Var]:
    """The variables ``op`` reads, one entry per use, tuple and list operands flattened, internal
    variables left out (``Operation.get_flattened_inputs`` without its copy)."""
    flat: list[Var] = []
    for value in op._input_vars.values():
        if type(value) is Var:
            flat.append(value)
        elif isinstance(value, (list, tuple)):
            flat.extend(value)
        elif value is not None and not isinstance(value, InternalVar):
            flat.append(value)
    return flat


def walk_blocks(prog: Program) -> Iterator[tuple[Block, list[Operation]]]:
    """Every block, outer blocks first, with its ops in program order (one walk over each op list)."""
    stack: list[Block] = list(prog.functions.values())[::-1]
    while stack:
        block = stack.pop()
        ops = list(block.operations)
        yield block, ops
        stack += reversed([inner for op in ops for inner in op.blocks])  # the first on top


class BlockIndex:
    """Index of one block's ops by type, kept current while the pass runs."""

    def __init__(self, block: Block, ops: list[Operation] | None = None) -> None:
        """``ops``: the block's ops in program order, if the caller has just listed them."""
        self.block = block
        by_type: dict[str, list[Operation]] = {}
        for op in block.operations if ops is None else ops:
            by_type.setdefault(type(op).__name__, []).append(op)  # op.op_type, without the property call
        self.by_type = by_type
        self.counts = Counter({t: len(v) for t, v in by_type.items()})
        self.inserted: list[Operation] = []  # while observed, in order
        self.removed: list[Operation] = []  # while observed, in order
        self._position: dict[int, float] | None = None
        self.observed = False  # whether insertions and removals are being recorded

    def observe(self) -> None:
        """Records ops inserted into and removed from the block, until ``release``."""
        if self.observed:
            return
        ops_list = self.block.operations
        original_insert = ops_list.insert_op_before
        original_remove = ops_list.remove
        inserted, removed, by_type, counts = self.inserted, self.removed, self.by_type, self.counts

        def insert_op_before(new_op: Operation, before_op: Operation | None = None) -> None:
            original_insert(new_op, before_op)
            inserted.append(new_op)
            op_type = type(new_op).__name__
            by_type.setdefault(op_type, []).append(new_op)
            counts[op_type] += 1
            if self._position is not None:
                self._place(self._position, ops_list.op_to_node[new_op])

        def remove(op: Operation) -> None:
            original_remove(op)
            removed.append(op)
            counts[type(op).__name__] -= 1

        ops_list.insert_op_before = insert_op_before
        ops_list.remove = remove
        self.observed = True

    def release(self) -> None:
        """Stops observing the block."""
        if self.observed:
            for attr in ("insert_op_before", "remove"):
                self.block.operations.__dict__.pop(attr, None)
            self.observed = False

    def tries(
        self,
        matcher: Matcher,
        anchor: int,
        ops: Iterable[Operation],
        accept: Callable[[Any], Any],
        stats: PassStats | None = None,
        **options: Any,
    ) -> Iterator[Any]:
        """The anchor loop: runs ``matcher.match_at`` with ``options`` at each of ``ops`` still in the block,
        as pattern op ``anchor``, offering each structural match to ``accept``; yields what each search
        returned. ``stats`` (default: ``matcher.stats``) counts the anchors and bindings tried."""
        block, match_at = self.block, matcher.match_at
        stats = matcher.stats if stats is None else stats
        for op in ops:
            if op.enclosing_block is block:
                stats.attempts += 1
                yield match_at(op, block, anchor, order=self.order, accept=accept, stats=stats, **options)

    def anchor_candidates(self, matcher: Matcher) -> tuple[int, list[Operation]] | None:
        """The anchor for ``matcher`` in this block and the ops of its type(s), in program order; None
        when some pattern op has no op of its type(s) in the block (the cheap rejection)."""
        if not self.possible(matcher):
            return None
        anchor = matcher.choose_anchor(self.counts)
        types = matcher.nodes[anchor].op_types
        candidates = [op for t in sorted(types) for op in self.by_type.get(t, ())]
        return anchor, (self.order(candidates) if len(types) > 1 else candidates)

    def possible(self, matcher: Matcher) -> bool:
        """Whether the block has an op of every pattern op's type(s) (else nothing can match)."""
        counts = self.counts
        return all(any(counts.get(op_type, 0) > 0 for op_type in types) for types in matcher.type_groups)

    def order(self, ops: list[Operation]) -> list[Operation]:
        """Sorts ``ops`` of this block into program order; ops no longer in the block go last."""
        position = self._position
        if position is None or any(id(op) not in position and op.enclosing_block is self.block for op in ops):
            position = self._reindex()
        return sorted(ops, key=lambda op: position.get(id(op), _LAST))

    def precedes(self, first: Operation, second: Operation) -> bool:
        """Whether ``first`` stands before ``second`` in the block (both in it)."""
        position = self._position
        if position is None or id(first) not in position or id(second) not in position:
            position = self._reindex()
        return position[id(first)] < position[id(second)]

    def _reindex(self) -> dict[int, float]:
        """The position of each op of the block, by id: indexed on demand, then kept current while the
        block is observed (:meth:`_place`)."""
        self._position = {id(op): float(i) for i, op in enumerate(self.block.operations)}
        return self._position

    def _place(self, position: dict[int, float], node: Any) -> None:
        """Gives the op of a just-inserted list node a position between its neighbours' (an end of the
        list counts as a neighbour one step away); forgets the positions if a neighbour has none or the
        floats run out of precision."""
        low = -1.0 if node.prev is None else position.get(id(node.prev.op))
        high = None if node.next is None else position.get(id(node.next.op))
        if low is not None and node.next is None:
            high = low + 2.0
        if high is not None and node.prev is None:
            low = high - 2.0
        if low is not None and high is not None and low < (place := (low + high) / 2) < high:
            position[id(node.op)] = place
        else:
            self._position = None


_LAST = float("inf")
