"""What a pass's rewrites changed: where to look again (:func:`revisit_candidates`), and whether the
changed ops keep coremltools' ``Block.validate`` invariants (:func:`validate_rewrite`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coremltools.converters.mil.mil import Block, Operation, Var

from ..matching.matcher import Matcher
from .blocks import flat_inputs

__all__ = ["Changes", "near", "revisit_candidates", "validate_rewrite"]


@dataclass
class Changes:
    """Where a sub-pass's rewrites may have made a new match: the seeds of :func:`revisit_candidates`."""

    log: dict[str, list[Operation]] | None = None
    """The run's log of changed ops by type, shared by the sub-passes (None: no other sub-pass)."""
    seeds: dict[Block, list[Operation]] = field(default_factory=dict)
    """Per block, ops of the pattern's types whose surroundings changed: created and rewired
    ops, and the producers of removed ops' inputs, in any block."""

    def take(self, block: Block) -> list[Operation]:
        """The seeds of ``block`` recorded so far, which are then forgotten."""
        return self.seeds.pop(block, [])

    def pending(self, blocks: list[Block]) -> list[Block]:
        """The blocks among ``blocks`` (in that order) with seeds to revisit; seeds in other blocks (created
        by a transform) are dropped: the next run of the pass searches those."""
        seeds = self.seeds
        found = [block for block in blocks if block in seeds]
        if len(found) != len(seeds):
            self.seeds = {block: seeds[block] for block in found}
        return found

    def seed(self, op: Operation) -> None:
        """Adds ``op`` to the seeds of its block (none if it is no longer in one)."""
        block = op.enclosing_block
        if block is not None:
            self.seeds.setdefault(block, []).append(op)

    def record(
        self, types: frozenset[str] | None, touched: list[Operation], removed: list[list[Var]]
    ) -> None:
        """Logs one rewrite's changed ops and seeds those of ``types`` (every type when None): the ops it
        created or rewired (``touched``), and the producers of what the ops it removed read (``removed``)."""
        changed = list(touched)
        for inputs in removed:
            for var in inputs:
                producer = var._op  # of any block; a removed producer has none and is left out
                if producer is not None and producer.enclosing_block is not None:
                    changed.append(producer)
        # A constant joins no match (no pattern op is a const): not a seed, unless every type is one (a
        # fan-out pattern depends on the users of what it reads); nor logged for the other sub-passes.
        log = self.log
        for op in changed:
            op_type = type(op).__name__
            if op_type == "const" and types is not None:
                continue
            if log is not None:
                log.setdefault(op_type, []).append(op)
            if types is None or op_type in types:
                self.seed(op)


def validate_rewrite(created: list[Operation], rewired: list[Operation], removed: list[Operation]) -> None:
    """Raises ValueError where ``Block.validate``'s invariants fail on the ops one rewrite changed (the
    messages say which)."""
    for op in removed:
        for var in flat_inputs(op):
            if op in var._child_ops:
                raise ValueError(f"removed op {op.name} is still listed as a user of {var.name}")
    for op in [*created, *rewired]:
        if op.enclosing_block is None:
            continue  # removed since
        inputs = flat_inputs(op)
        for var in inputs:
            listed = var._child_ops.count(op)
            uses = inputs.count(var) if len(inputs) > 1 else 1
            if listed != uses:
                raise ValueError(
                    f"after the rewrite, {var.name} lists op {op.name} {listed} times among its "
                    f"users, but the op reads it {uses} times"
                )
        for var in op._output_vars:
            for user in var._child_ops:
                if user.enclosing_block is None:
                    raise ValueError(f"op {user.name} reads {var.name} but is no longer in a block")
            for consumer_block in var.consuming_blocks:
                if var not in consumer_block.outputs:
                    raise ValueError(f"{var.name} claims to be an output of {consumer_block.name}")


def revisit_candidates(
    seeds: list[Operation], block: Block, matcher: Matcher, anchor: int
) -> list[tuple[int, list[Operation]]]:
    """The searches (pattern op, the ops to try as it) that a round of rewrites may have made succeed:
    the anchor-type ops within the anchor's radius of a seed; and, if :attr:`Matcher.joins_through_roots`,
    each seed as every other pattern op of its type."""
    seeds = [op for op in dict.fromkeys(seeds) if op.enclosing_block is block]
    candidates = near(seeds, block, matcher.nodes[anchor].op_types, matcher.radius[anchor])
    searches = [(anchor, candidates)] if candidates else []
    if matcher.joins_through_roots:
        by_type = matcher.anchors_by_type
        searches += [(at, [op]) for op in seeds for at in by_type.get(op.op_type, ()) if at != anchor]
    return searches


def near(seeds: list[Operation], block: Block, anchor_types: frozenset[str], radius: int) -> list[Operation]:
    """Anchor candidates within ``radius`` producer/consumer steps of a seed op, in discovery order."""
    seen = dict.fromkeys(seeds)  # ops hash by identity
    frontier = list(seen)
    for _ in range(radius):
        nxt: list[Operation] = []
        for op in frontier:
            neighbours: list[Operation] = []
            for var in flat_inputs(op):
                producer = var.op
                if producer is not None:
                    if producer.op_type == "const":
                        continue  # constants may feed thousands of ops and join no match
                    neighbours.append(producer)
                neighbours.extend(var._child_ops)  # siblings: ops joined through a shared input
            for var in op._output_vars:
                neighbours.extend(var._child_ops)
            for other in neighbours:
                if other not in seen and other.enclosing_block is block:
                    seen[other] = None
                    nxt.append(other)
        frontier = nxt
    return [op for op in seen if op.op_type in anchor_types and op.enclosing_block is block]
