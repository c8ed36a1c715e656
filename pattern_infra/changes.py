"""What a pass's rewrites changed: where to look again, and what to validate.

Owns: :class:`Changes` (the ops created, removed and rewired, in order; their seeds per block; the
log by type the other sub-passes revisit), :meth:`Changes.validate` with :func:`check_op` (coremltools'
``Block.validate`` invariants on the changed ops only), :func:`broken_contract` (what one rewrite must
leave: its new ops used and in order, the block's outputs kept) with :func:`returned_names` and
:func:`read_only_constants`, and :func:`revisit_candidates` with :func:`near` (the anchor candidates a
round of rewrites may have made matchable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from coremltools.converters.mil.mil import Block, Function, Operation, Var

from .blocks import flat_inputs
from .matcher import Matcher

__all__ = [
    "Changes",
    "broken_contract",
    "check_op",
    "near",
    "read_only_constants",
    "returned_names",
    "revisit_candidates",
]


@dataclass
class Changes:
    """The ops a sub-pass's rewrites created, removed and rewired, in the order they happened.

    Only these can take part in a match that did not exist before (see :func:`revisit_candidates`), and only
    these can break the block's invariants (see :meth:`validate`).
    """

    created: list[Operation] = field(default_factory=list)
    """Ops inserted into the block by the transforms."""
    rewired: list[Operation] = field(default_factory=list)
    """Ops outside the matches that read a match output before the transform (their inputs moved)."""
    removed_by_transforms: list[Operation] = field(default_factory=list)
    """Ops a transform took out of the block itself; the others went through :func:`remove_dead_ops`,
    which unlists them from their inputs' users (``Var.remove_child_op``) or raises."""
    checked: tuple[int, int, int] = (0, 0, 0)
    """How many of ``removed_by_transforms``, ``created`` and ``rewired`` :meth:`validate` has checked."""
    log: dict[str, list[Operation]] | None = None
    """The run's log of changed ops by type, shared by the sub-passes (see :attr:`_Run.log`); None when
    the run has no other sub-pass to revisit them."""
    seeds: dict[int, list[Operation]] = field(default_factory=dict)
    """Per block (by id), ops whose surroundings changed and whose type the pattern has: created and
    rewired ops, and the producers of the inputs of removed ops (they lost a consumer), whatever block
    they lie in. Collected right after each rewrite, while its ops are in the cache."""

    def take(self, block: Block) -> list[Operation]:
        """The seeds of ``block`` recorded so far, which are then forgotten."""
        return self.seeds.pop(id(block), [])

    def pending(self, blocks: list[Block]) -> list[Block]:
        """The blocks among ``blocks`` (in that order) with seeds to revisit. Seeds in blocks that are not
        among them (created by a transform) are dropped: the next run of the pass searches those."""
        seeds = self.seeds
        if not seeds:
            return []
        found = [block for block in blocks if id(block) in seeds]
        if len(found) != len(seeds):
            keep = {id(block) for block in found}
            self.seeds = {k: v for k, v in seeds.items() if k in keep}
        return found

    def seed(self, op: Operation) -> None:
        """Adds ``op`` to the seeds of its block (none if it is no longer in one)."""
        block = op.enclosing_block
        if block is not None:
            same = self.seeds.get(id(block))
            if same is None:
                self.seeds[id(block)] = [op]
            else:
                same.append(op)

    def record(
        self,
        types: frozenset[str] | None,
        created: list[Operation],
        dead: list[tuple[Operation, list[Var]]],
        removed_by_transform: list[Operation],
        rewired: list[Operation],
    ) -> None:
        """Adds one rewrite's changes to the lists, and their seeds (of every type when ``types`` is
        None). ``dead``: the matched ops the framework removed, each with the variables it read (as
        :func:`remove_dead` listed them); ``removed_by_transform``: the ops the transform removed."""
        self.created += created
        self.rewired += rewired
        removed_inputs = [inputs for _, inputs in dead]
        if removed_by_transform:
            self.removed_by_transforms += removed_by_transform
            removed_inputs += [flat_inputs(op) for op in removed_by_transform]
        # A constant joins no match (no pattern op is a const): not a seed, unless every type is one (a
        # fan-out pattern depends on the users of what it reads); nor logged for the other sub-passes.
        consts = types is not None
        changed = [*created, *rewired]
        for inputs in removed_inputs:
            for var in inputs:
                producer = var._op  # of any block; a removed producer has none and is left out
                if (
                    producer is not None
                    and producer.enclosing_block is not None
                    and not (consts and type(producer).__name__ == "const")
                ):
                    changed.append(producer)
        log = self.log
        for op in changed:
            op_type = type(op).__name__
            if op_type == "const" and consts:
                continue
            if log is not None:
                same_type = log.get(op_type)
                if same_type is None:
                    log[op_type] = [op]
                else:
                    same_type.append(op)
            if types is None or op_type in types:
                self.seed(op)

    def validate(self) -> None:
        """Block.validate's invariants, where the rewrites could have broken them.

        A removed op is no longer listed as a user of its inputs; every created or rewired op still in
        its block is listed by each variable it reads as often as it reads it, its outputs' users are
        all in a block, and the blocks its outputs claim to be returned by do return them. Linear in
        the size of the changes.

        Only the changes recorded since the last call are checked: the driver calls this right after
        each rewrite, while its ops are still in the cache.

        Raises:
            ValueError: An invariant does not hold (the caller restores the program).
        """
        removed, created, rewired = self.removed_by_transforms, self.created, self.rewired
        start_removed, start_created, start_rewired = self.checked
        self.checked = (len(removed), len(created), len(rewired))
        for i in range(start_removed, len(removed)):
            op = removed[i]
            for var in flat_inputs(op):
                if op in var._child_ops:
                    raise ValueError(f"removed op {op.name} is still listed as a user of {var.name}")
        for ops, start in ((created, start_created), (rewired, start_rewired)):
            for i in range(start, len(ops)):
                op = ops[i]
                if op.enclosing_block is not None:  # else removed since
                    check_op(op)



def revisit_candidates(
    seeds: list[Operation], block: Block, matcher: Matcher, anchor: int
) -> tuple[list[Operation], list[tuple[Operation, int]]]:
    """The anchor candidates a round of rewrites may have made matchable.

    A match that did not exist before the round contains an op whose inputs or whose outputs' users
    changed: a created op, a rewired op, or the producer of a removed op's input. Only those of the
    pattern's op types can be in a match (:attr:`Changes.seeds`), so when there is none (a GELU fusion
    creates a ``gelu`` and rewires a ``relu``), nothing is revisited. A pattern with a fan-out node also
    depends on the users of a variable it does not capture, so for it every changed op is a seed,
    whatever its type.

    Returns:
        The anchor-type ops within the anchor's radius of a seed (the walk does not go through
        constants, which may feed thousands of ops); and, for a pattern whose parts may meet only at a
        pattern input (:attr:`Matcher.joins_through_roots`), each seed paired with every other pattern
        op of its type, to be tried as that op's anchor: a match through a shared constant contains a
        seed, and the search from it reaches the other parts.
    """
    seeds = [op for op in dict.fromkeys(seeds) if op.enclosing_block is block]
    if not seeds:
        return [], []
    candidates = near(seeds, block, matcher.nodes[anchor].op_types, matcher.radius[anchor])
    extra: list[tuple[Operation, int]] = []
    if matcher.joins_through_roots:
        by_type = matcher.anchors_by_type
        extra = [(op, at) for op in seeds for at in by_type.get(op.op_type, ()) if at != anchor]
    return candidates, extra


def check_op(op: Operation) -> None:
    """The invariants of :meth:`Changes.validate` for one op still in a block."""
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



USE_THE_NEW_OPS = (
    "Call pattern.replace_output(new_var) (or replace_outputs) to redirect the match's users to the "
    "replacement, and build only the ops the replacement needs; the framework then removes the matched ops."
)
"""The fix of a rewrite that leaves a new op unused (a forgotten ``replace_output``)."""

BEFORE_ITS_USERS = (
    "Insert each new op before its first user: mb.<op>(..., before_op=pattern.<final op>) (an op built "
    "without before_op goes to the end of the block, after the ops that read it), inside the match's block."
)
"""The fix of a rewrite that leaves an op reading a variable it cannot see."""

KEEP_THE_OUTPUTS = (
    "Leave a block's outputs to pattern.replace_output(new_var): it keeps a returned variable's name "
    "(the model's output names); never set the outputs in a transform."
)
"""The fix of a rewrite that renamed, dropped or added an output of its block."""

Precedes = Callable[[Block, Operation, Operation], bool]
"""Whether an op stands before another in a block (:meth:`~pattern_infra.blocks.BlockIndex.precedes`)."""


def returned_names(block: Block) -> tuple[str, ...] | int:
    """What a rewrite must keep of ``block``'s outputs: their names for a function (the model's outputs),
    their number for a nested block (its op's outputs)."""
    outputs = block._outputs
    if isinstance(block, Function):
        return tuple(var.name for var in outputs)
    return len(outputs)


def broken_contract(
    created: list[Operation], rewired: list[Operation], block: Block, returned: tuple[str, ...] | int,
    precedes: Precedes, replacements: Sequence[Var] = (),
) -> tuple[str, str] | None:
    """What one rewrite broke of its contract, as (the mistake, its fix); None when it kept it.

    The contract: every op the rewrite created is used (read by an op, returned by a block, or given to
    ``replace_output`` for an output nothing read); each
    created op reads only variables defined before it, in its block or an enclosing one, and stands
    before each of its users (before the op holding the user's block, for a user in a nested block);
    so do the ops outside the match whose inputs moved (``rewired``), and the block's returned
    variables are its own or an enclosing block's; the block returns what it returned (``returned``,
    from :func:`returned_names` before the rewrite). Only these ops are looked at: linear in the size
    of the rewrite (plus the block's outputs).

    Args:
        created: The ops the rewrite inserted into ``block`` (those removed again are skipped).
        rewired: The ops outside the match that read its outputs before the rewrite.
        block: The match's block.
        returned: :func:`returned_names` of ``block`` before the rewrite.
        precedes: Whether an op stands before another in a block.
        replacements: The variables the transform gave to ``replace_output``.
    """
    now = returned_names(block)
    if now != returned:
        if isinstance(now, int):
            return f"changed the number of outputs of block {block.name} from {returned} to {now}", KEEP_THE_OUTPUTS
        return (f"changed the outputs of function {block.name} from [{', '.join(returned)}] to "
                f"[{', '.join(now)}]", KEEP_THE_OUTPUTS)
    live = [op for op in created if op.enclosing_block is not None]
    unused = [
        op for op in live
        if not any(var._child_ops or var.consuming_blocks or var in replacements for var in op._output_vars)
    ]
    if unused:
        return f"built [{', '.join(op.name for op in unused)}] but nothing uses them", USE_THE_NEW_OPS
    for op in live:
        for var in op._output_vars:
            for user in var._child_ops:
                problem = _unseen(var, user, precedes)
                if problem is not None:
                    return problem, BEFORE_ITS_USERS
    for op in live:
        for var in flat_inputs(op):
            problem = _unseen(var, op, precedes)
            if problem is not None:
                return problem, BEFORE_ITS_USERS
    for op in rewired:
        here = op.enclosing_block
        if here is not None:
            for var in flat_inputs(op):
                producer = var._op
                if producer is None or producer in live or producer.enclosing_block is here:
                    continue  # a new op's users are checked above; rewrites move no op that was there
                problem = _unseen(var, op, precedes)  # a removed op, or one of another block
                if problem is not None:
                    return problem, BEFORE_ITS_USERS
    for var in block._outputs:
        producer = var._op
        if producer is not None and not _encloses(producer.enclosing_block, block):
            return f"made block {block.name} return {var.name}, defined outside it", BEFORE_ITS_USERS
    return None


def _unseen(var: Var, user: Operation, precedes: Precedes) -> str | None:
    """Why ``user`` cannot read ``var`` where it stands, or None if it can."""
    producer = var._op
    if producer is None:
        return None  # an input of a function or of a block
    home = producer.enclosing_block
    if home is None:
        return f"left {user.name} reading {var.name}, whose op {producer.name} was removed"
    holder = _holder(home, user)
    if holder is None:
        return f"left {user.name} reading {var.name}, defined in block {home.name}, which does not enclose it"
    if holder is producer or not precedes(home, producer, holder):
        where = "" if holder is user else f" (it lies inside {holder.name})"
        return f"left {user.name} reading {var.name}, which is computed after it{where}"
    return None


def _holder(home: Block, user: Operation) -> Operation | None:
    """The op of ``home`` that is ``user`` or holds the block ``user`` lies in; None when ``home`` does
    not enclose ``user``."""
    op, block = user, user.enclosing_block
    while block is not home:
        op = block.outer_op if block is not None else None
        if op is None:
            return None
        block = op.enclosing_block
    return op


def _encloses(home: Block | None, block: Block) -> bool:
    """Whether ``home`` is ``block`` or a block around it."""
    outer = block.outer_op
    return block is home or (home is not None and outer is not None and _holder(home, outer) is not None)


def read_only_constants(ops: Iterable[Operation]) -> list[np.ndarray]:
    """Makes the tensor values of the constants ``ops`` read read-only, and returns those that were
    writable (to make them writable again). Only arrays that own their memory: numpy may refuse to make
    a view writable again. A transform writing into one, which may be shared by other
    ops and which the undo journal does not copy, then raises instead of changing them."""
    frozen: list[np.ndarray] = []
    for op in ops:
        for operand in op._input_vars.values():  # flat_inputs' walk, without building its list
            for var in operand if isinstance(operand, (list, tuple)) else (operand,):
                producer = getattr(var, "_op", None)
                if producer is not None and type(producer).__name__ == "const" and var._sym_val is not None:
                    value = var._sym_val.val
                    if type(value) is np.ndarray and value.flags.writeable and value.flags.owndata:
                        value.flags.writeable = False
                        frozen.append(value)
    return frozen


def near(seeds: list[Operation], block: Block, anchor_types: frozenset[str], radius: int) -> list[Operation]:
    """Anchor candidates within ``radius`` producer/consumer steps of a seed op, in no set order
    but deterministic (discovery order)."""
    seen: dict[int, Operation] = {}
    frontier = list(dict.fromkeys(seeds))
    for op in frontier:
        seen[id(op)] = op
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
                if id(other) not in seen and other.enclosing_block is block:
                    seen[id(other)] = other
                    nxt.append(other)
        frontier = nxt
        if not frontier:
            break
    return [op for op in seen.values() if op.op_type in anchor_types and op.enclosing_block is block]


