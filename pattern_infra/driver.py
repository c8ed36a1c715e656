"""Apply compiled patterns to a program in time linear in its size, and lose nothing on failure.

How a group of sub-passes runs on a program (``run_subpasses``):

1. Every block, nested ones included, is listed once, and its ops are indexed by type once. The block's
   op list is observed for the duration of the pass: ops inserted by transforms join the index as they
   are inserted (later sub-passes see them without a rescan), and every insertion and removal is
   recorded.
2. For each sub-pass, in order, and each block: the anchor is the pattern op whose type is rarest in the
   block, and only ops of that type are tried. Each structural match is offered, inside the search, to
   the user's constraints and then the transform (:func:`_offer`); a match they turn down lets the search
   go on to the next structural match at the same anchor op. The matched ops left without users are
   removed together (consumers first, in the pattern's order reversed), unlinked directly rather than
   through ``Block.remove_ops``, whose checks the dead-op test has already made (see
   :func:`remove_dead_ops`). What the rewrite did is recorded as :class:`_Changes`: the ops created, the
   ops removed, and the ops outside the match whose inputs were redirected.
3. Nothing is rescanned from the start. A match that did not exist before a round of rewrites contains
   an op whose inputs or whose outputs' users changed: a created op, a redirected op, or the producer of
   a removed op's input, in whatever block it lies. Only those of the pattern's op types can be part of
   a match; when there are some, the anchor candidates within the pattern's radius of them (the anchor's
   eccentricity in the pattern graph, plus one hop) are tried again, and, for a pattern whose parts meet
   only at a pattern input, each such op as every pattern op of its type; blocks are revisited until no
   block has anything left (an inner rewrite may free an outer match). A GELU fusion creates a ``gelu``
   and redirects a ``relu``: no revisit at all. A pass still rewriting after ``max_iterations`` rounds
   re-creates its own pattern: :class:`FixpointError`. Every change is also logged by op type for the
   other sub-passes: after the last one, each revisits what the later ones changed
   (:func:`_revisit_earlier`), until a round rewrites nothing, so the pass ends at a fixpoint.
4. The first time a transform is about to run, an undo journal opens (:mod:`pattern_infra.journal`):
   from then on, the first change to an op or variable saves its state, copy-on-write, and every op
   of a match, and every user of its outputs, is saved before its transform runs. If a constraint or
   transform raises, or the validation after a rewrite (after a sub-pass, with ``"full"``) finds the
   program inconsistent, the program is restored from it, identical to what it was before the pass,
   and :class:`PassExecutionError` names the pass, the pattern and (for a callback) the matched ops.
   The validation checks coremltools' ``Block.validate`` invariants on the recorded changes only
   (see :meth:`_Changes.validate`).
5. A block's builder context (``with block:``) is entered only when a rewrite needs it, and a
   function's block stays entered for the rest of the run; cyclic GC is paused during the run. A
   sub-pass whose op types are not all present in some block costs one check per block.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program, Var
from coremltools.converters.mil.mil.utils import CacheDoublyLinkedList
from coremltools.converters.mil.mil.var import InternalVar

from .compiler import CompiledPattern
from .errors import FixpointError, PassExecutionError, PatternInfraError
from .journal import Journal, flat_inputs, journals_on_this_thread
from .matcher import Matcher
from .pattern import Pattern
from . import tracing

__all__ = [
    "DEFAULT_MAX_ITERATIONS",
    "PassStats",
    "SubPass",
    "iter_blocks",
    "run_subpasses",
    "find_in_program",
    "remove_dead_ops",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_ITERATIONS = 32
"""Rounds of re-visiting touched ops before a pass is declared to re-create its own pattern."""

Constraints = Callable[[Pattern], Any]
Transform = Callable[[Pattern], Any]


@dataclass
class PassStats:
    """Counters of one sub-pass (or a whole pass), cumulative over runs."""

    runs: int = 0
    """How many times the sub-pass was applied to a program."""
    attempts: int = 0
    """Anchor ops tried."""
    bind_attempts: int = 0
    """Ops the matcher tried to bind (anchors included): its unit of work."""
    matches: int = 0
    """Complete structural matches."""
    rejected: int = 0
    """Matches that ``var_constraints`` turned down."""
    rejections: Counter[str] = field(default_factory=Counter)
    """How often each reason was given for turning a match down (see :func:`constraint_verdict`)."""
    declined: int = 0
    """Matches whose transform returned False."""
    rewrites: int = 0
    """Matches rewritten."""
    iterations: int = 0
    """Sweeps done (the first one included)."""
    seconds: float = 0.0
    """Wall time spent."""

    def add(self, other: PassStats) -> None:
        """Adds ``other``'s counters to these."""
        for name in self.__dataclass_fields__:
            if name == "rejections":
                if other.rejections:
                    self.rejections.update(other.rejections)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class SubPass:
    """One pattern with its callbacks, as registered."""

    compiled: CompiledPattern
    """The pattern."""
    var_constraints: Constraints | None
    """Returns truthy to accept a match (None accepts all)."""
    transform_pattern: Transform
    """Rewrites a match; returning False declines (and must change nothing)."""
    priority: int = 0
    """Higher runs earlier in its group; equal priorities keep registration order."""
    max_iterations: int = DEFAULT_MAX_ITERATIONS
    """Cap on re-visit rounds, see :class:`FixpointError`."""
    stats: PassStats = field(default_factory=PassStats)
    """Cumulative counters."""
    matcher: Matcher = field(init=False)
    """The search for :attr:`compiled`."""

    seed_types: frozenset[str] | None = field(init=False)
    """The op types a revisit starts from (the pattern's), or None for every type (fan-out patterns)."""

    def __post_init__(self) -> None:
        self.matcher = Matcher(self.compiled)
        fanout = any(node.fanout for node in self.compiled.nodes)
        self.seed_types = None if fanout else self.matcher.op_types

    @property
    def name(self) -> str:
        """The pattern's name."""
        return self.compiled.name


def iter_blocks(prog: Program) -> Iterator[Block]:
    """Every block of every function, outer blocks before the blocks nested in their ops."""
    for block, _ in _walk(prog):
        yield block


def _walk(prog: Program) -> Iterator[tuple[Block, list[Operation]]]:
    """Every block, outer blocks first, with its ops in program order (one walk over each op list)."""
    for func in prog.functions.values():
        yield from _walk_block(func)


def _walk_block(block: Block) -> Iterator[tuple[Block, list[Operation]]]:
    ops = list(block.operations)
    yield block, ops
    for op in ops:
        for inner in op.blocks:
            yield from _walk_block(inner)


class _BlockState:
    """Index of one block's ops by type, kept current while the pass runs."""

    def __init__(self, block: Block, ops: list[Operation] | None = None) -> None:
        """``ops``: the block's ops in program order, if the caller has just listed them."""
        self.block = block
        self.by_type: dict[str, list[Operation]] = {}
        by_type = self.by_type
        for op in block.operations if ops is None else ops:
            op_type = type(op).__name__  # Operation.op_type, without the property call
            same = by_type.get(op_type)
            if same is None:
                by_type[op_type] = [op]
            else:
                same.append(op)
        self.counts = Counter({t: len(v) for t, v in by_type.items()})
        self.inserted: list[Operation] = []
        """Ops inserted into the block while observed, in insertion order."""
        self.removed: list[Operation] = []
        """Ops removed from the block while observed, in removal order."""
        self._position: dict[int, float] | None = None
        self.observed = False
        """Whether insertions and removals are being recorded (the op list could be observed)."""

    def observe(self) -> None:
        """Records ops inserted into and removed from the block, until ``release``."""
        if self.observed:
            return
        ops_list = self.block.operations
        if not isinstance(ops_list, CacheDoublyLinkedList):
            return
        original_insert = ops_list.insert_op_before
        original_remove = ops_list.remove
        inserted, removed, by_type, counts = self.inserted, self.removed, self.by_type, self.counts
        state = self

        def insert_op_before(new_op: Operation, before_op: Operation | None = None) -> None:
            original_insert(new_op, before_op)
            inserted.append(new_op)
            op_type = type(new_op).__name__
            by_type.setdefault(op_type, []).append(new_op)
            counts[op_type] += 1
            if state._position is not None:
                state._place(ops_list.op_to_node[new_op])

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
            ops_list = self.block.operations
            for attr in ("insert_op_before", "remove"):
                ops_list.__dict__.pop(attr, None)
            self.observed = False

    def anchor_candidates(self, matcher: Matcher) -> tuple[int, list[Operation]] | None:
        """The anchor for ``matcher`` in this block and the ops of its type(s), in program order.

        None when some pattern op has no op of its type(s) in the block: nothing can match (the cheap
        rejection, before any search).
        """
        if not self.possible(matcher):
            return None
        anchor = matcher.choose_anchor(self.counts)
        types = matcher.nodes[anchor].op_types
        candidates = [op for t in sorted(types) for op in self.by_type.get(t, ())]
        return anchor, (self.order(candidates) if len(types) > 1 else candidates)

    def possible(self, matcher: Matcher) -> bool:
        """Whether the block has an op of every pattern op's type(s) (else nothing can match)."""
        counts = self.counts
        for types in matcher.type_groups:
            for op_type in types:
                if counts.get(op_type, 0) > 0:
                    break
            else:
                return False
        return True

    def order(self, ops: list[Operation]) -> list[Operation]:
        """Sorts ``ops`` of this block into program order; ops no longer in the block go last.

        The block is indexed on the first call; ops inserted later get a position between their
        neighbours' (see ``_place``), so the index is rebuilt only when an op was inserted while the
        block was not observed.
        """
        position = self._position
        block = self.block
        if position is None or any(id(op) not in position and op.enclosing_block is block for op in ops):
            position = self._position = {id(op): float(i) for i, op in enumerate(block.operations)}
        return sorted(ops, key=lambda op: position.get(id(op), _LAST))

    def _place(self, node: Any) -> None:
        """Gives the op of a just-inserted list node a position between its neighbours'."""
        position = self._position
        if position is None:
            return
        before = position.get(id(node.prev.op)) if node.prev is not None else None
        after = position.get(id(node.next.op)) if node.next is not None else None
        if before is None and after is None:
            place = 0.0 if node.prev is None and node.next is None else None
        elif after is None:
            place = before + 1.0 if node.next is None else None
        elif before is None:
            place = after - 1.0 if node.prev is None else None
        else:
            place = (before + after) / 2
            if not before < place < after:  # out of float precision: index again when next needed
                place = None
        if place is None:
            self._position = None
        else:
            position[id(node.op)] = place


_LAST = float("inf")


class _Run:
    """One application of a group of sub-passes to a program."""

    def __init__(self, prog: Program, pass_name: str, validate: bool | str) -> None:
        self.prog = prog
        self.pass_name = pass_name
        self.validate = validate
        self.journal: Journal | None = None
        """Opened before the first transform runs (see :mod:`pattern_infra.journal`)."""
        walked = list(_walk(prog))
        self.blocks: list[Block] = [block for block, _ in walked]
        """Every block, listed once at the start (nothing changes before the journal opens)."""
        self.ops_at_start: dict[int, list[Operation]] = {id(block): ops for block, ops in walked}
        """Each block's ops as listed at the start, for its index while nothing has been rewritten."""
        self.states: dict[int, _BlockState] = {}
        self.log: dict[str, list[Operation]] | None = None
        """Every op a rewrite of any sub-pass created, rewired or left with fewer users, by type: what
        the other sub-passes of its pass revisit (:func:`_revisit_earlier`). None while the sub-passes
        running have no other to revisit their changes."""
        self.changes = _Changes()
        """What the current sub-pass's rewrites did, for the revisits and the validation."""
        self.rounds: dict[int, int] = {}
        """Per block (by id), the rounds the current sub-pass has swept it: the fixpoint cap."""
        self.open_block: Block | None = None

    def close(self) -> None:
        """Leaves the function block kept open by :class:`_LazyBlockContext`, if any."""
        if self.open_block is not None:
            block, self.open_block = self.open_block, None
            self.keep_block(block)
            block.__exit__(None, None, None)

    def log_position(self) -> dict[str, int]:
        """How much of :attr:`log` there is now, per type."""
        return {op_type: len(ops) for op_type, ops in self.log.items()} if self.log else {}

    def keep_block(self, block: Block) -> None:
        """Saves the variables ``Block.__exit__`` is about to rewrite, while the journal is open."""
        if self.journal is not None and not self.journal.closed:
            self.journal.keep_block(block)

    def state(self, block: Block) -> _BlockState:
        st = self.states.get(id(block))
        if st is None:
            ops = self.ops_at_start.get(id(block)) if self.journal is None else None
            st = _BlockState(block, ops)
            self.states[id(block)] = st
        return st

    def fail(self, sub: SubPass, what: str, match: Pattern, exc: BaseException) -> PassExecutionError:
        restored = self.restore()  # first: the message names the ops as they are again, not as renamed
        ops = ", ".join(f"{op.name} ({op.op_type})" for op in match.op_list())
        note = (
            "The program was restored to its state before the pass."
            if restored
            else "The program had not been changed yet."
        )
        return PassExecutionError(
            f"Pass {self.pass_name!r}, pattern {sub.name!r}: {what} raised "
            f"{type(exc).__name__}: {exc}, on the match [{ops}]. {note}"
        )

    def refuse(self, sub: SubPass, match: Pattern, problem: str, fix: str) -> PassExecutionError:
        """Restores the program; the error for a transform that broke the rules without raising."""
        restored = self.restore()
        ops = ", ".join(f"{op.name} ({op.op_type})" for op in match.op_list())
        note = " The program was restored to its state before the pass." if restored else ""
        return PassExecutionError(
            f"Pass {self.pass_name!r}, pattern {sub.name!r}: on the match [{ops}], transform_pattern "
            f"{problem}. {fix}{note}"
        )

    def restore(self) -> bool:
        self.release()
        if self.journal is None:
            return False
        self.journal.restore()
        return True

    def release(self) -> None:
        for st in self.states.values():
            st.release()

    def close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()


def run_subpasses(
    prog: Program,
    subpasses: list[SubPass],
    pass_name: str,
    *,
    validate: bool | str = True,
    passes: Sequence[int] | None = None,
) -> PassStats:
    """Applies each sub-pass, in order, to every block of ``prog``.

    Args:
        prog: The program, changed in place.
        subpasses: The sub-passes, already in run order.
        pass_name: Pass id, for messages.
        validate: ``True`` checks the invariants of coremltools' ``Block.validate`` on the ops each
            rewrite created or rewired, right after it (linear in what changed); ``"full"`` validates
            the whole program after each sub-pass that rewrote; ``False`` skips it. coremltools'
            pipeline validates the whole program after every pass anyway.
        passes: For several passes applied in one call, the pass each sub-pass belongs to (consecutive
            sub-passes of one pass share a number). Each pass reaches its own fixpoint (its sub-passes
            revisit each other's changes) before the next one starts, as when they run one by one.
            None: all sub-passes form one pass.

    Returns:
        The counters of this run, summed over the sub-passes.

    Raises:
        PassExecutionError: A callback raised; the program is as it was before the call.
        FixpointError: A sub-pass kept re-creating its pattern; the program is as it was before.
    """
    run = _Run(prog, pass_name, validate)
    total = PassStats()
    # A rewrite allocates many small objects; with a large graph alive, each generational collection
    # walks all of it. Cyclic GC is paused for the pass (reference counting still frees memory) and
    # restored as it was; what the pass allocated and kept is then promoted (_promote_survivors).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        blocks = run.blocks
        for group in _groups(subpasses, passes):
            seen: list[dict[str, int]] = []
            run.log = {} if len(group) > 1 else None
            run.changes.log = run.log
            for sub in group:
                if any(run.state(block).possible(sub.matcher) for block in blocks):
                    total.add(_apply(run, sub, first=True))
                else:
                    sub.stats.runs += 1  # no block holds every op type of the pattern: nothing to do
                    total.runs += 1
                if run.log is not None:
                    seen.append(run.log_position())
            if run.log is not None:
                _revisit_earlier(run, group, seen, total)
    except PatternInfraError:
        raise
    except Exception as exc:  # an error of coremltools' own while applying the rewrite
        run.restore()
        raise PassExecutionError(
            f"Pass {pass_name!r} failed while rewriting: {type(exc).__name__}: {exc}. The program "
            f"was restored to its state before the pass."
        ) from exc
    finally:
        run.close_journal()  # first: leaving the function block rewrites every variable of it
        run.close()
        run.release()
        run.journal = None  # its saved states are freed here, by reference counting
        _promote_survivors()
        if gc_was_enabled:
            gc.enable()
    return total


def _groups(subpasses: list[SubPass], passes: Sequence[int] | None) -> list[list[SubPass]]:
    """The sub-passes cut into runs of one pass each (see ``run_subpasses``' ``passes``)."""
    if passes is None:
        return [subpasses] if subpasses else []
    if len(passes) != len(subpasses):
        raise ValueError(f"passes names {len(passes)} sub-passes, but {len(subpasses)} were given")
    groups: list[list[SubPass]] = []
    for i, sub in enumerate(subpasses):
        if i == 0 or passes[i] != passes[i - 1]:
            groups.append([])
        groups[-1].append(sub)
    return groups


def _apply(run: _Run, sub: SubPass, *, first: bool) -> PassStats:
    """One sub-pass over the program: every block (``first``), or the blocks with seeds to revisit.

    A rewrite may free a match in another block (an inner rewrite drops a use of an outer variable; an
    outer one rewires ops of an inner block): those blocks are swept again, from what changed in them,
    until no block has anything left to revisit.
    """
    blocks = run.blocks
    stats = PassStats(runs=1 if first else 0)
    start = time.perf_counter()
    bind_before = sub.matcher.bind_attempts
    run.rounds = {}
    pending = blocks if first else run.changes.pending(blocks)
    while pending:
        for block in pending:
            if _live(block):
                with _LazyBlockContext(run, block) as context:
                    _sweep(run, sub, run.state(block), stats, context, first=first)
        first = False
        pending = run.changes.pending(blocks)
    stats.bind_attempts = sub.matcher.bind_attempts - bind_before
    stats.seconds = time.perf_counter() - start
    sub.stats.add(stats)
    if stats.rewrites and run.validate == "full":  # otherwise each rewrite was checked (_rewrite)
        try:
            run.prog.validate()
        except Exception as exc:
            raise _inconsistent(run, sub, exc) from exc
    run.changes = _Changes(log=run.log)
    return stats


def _revisit_earlier(run: _Run, subpasses: list[SubPass], seen: list[dict[str, int]], total: PassStats) -> None:
    """Lets each sub-pass revisit what the others changed after it ran, until a round rewrites nothing.

    A later sub-pass's rewrite may create or free a match of an earlier one; every rewrite's changed ops
    are logged by type (:attr:`_Run.log`), and each sub-pass takes the ones of its types it has not seen.
    Costs a dictionary lookup per sub-pass and type when the rewrites touched none of its types.
    """
    limit = max(sub.max_iterations for sub in subpasses)
    for _ in range(limit):
        rewrites = total.rewrites
        for k, sub in enumerate(subpasses):
            if not any(run.state(block).possible(sub.matcher) for block in run.blocks if _live(block)):
                continue  # no block holds every op type of its pattern (its position stays: still correct)
            position = seen[k]
            types = sorted(sub.seed_types) if sub.seed_types is not None else list(run.log)
            for op_type in types:
                for op in run.log.get(op_type, ())[position.get(op_type, 0):]:
                    run.changes.seed(op)
            if run.changes.seeds:
                total.add(_apply(run, sub, first=False))
            seen[k] = run.log_position()
        if total.rewrites == rewrites:
            return
    run.restore()
    raise FixpointError(
        f"Pass {run.pass_name!r}: its sub-passes kept re-creating each other's patterns for {limit} rounds "
        f"({', '.join(sub.name for sub in subpasses)}); make each replacement differ from the other patterns. "
        f"The program was restored to its state before the pass."
    )


_PROMOTE_ABOVE = 20_000
"""Young objects above which the pass's survivors are promoted rather than collected."""


def _promote_survivors() -> None:
    """Moves the objects allocated since the last collection to the oldest generation, unexamined,
    when there are many of them.

    With collection paused, everything the pass allocated and still holds (new ops, variables, their
    dicts: the rewritten program) is young, and the first allocation after the pass would trigger a
    collection of all of it: at N = 1000 GELU fusions, 16 us per fusion, most of it cache misses on
    objects that are alive anyway (3.7 us at N = 200, where they still fit in the cache).
    ``gc.freeze()`` then ``gc.unfreeze()`` moves every tracked object to the oldest generation in
    constant time (each generation list is spliced, nothing traversed); the next full collection
    examines them like the rest of the program. Objects the process froze itself (e.g. before a fork,
    or this project's test suite) would be unfrozen too: then nothing is moved. Asking for that
    (``gc.get_freeze_count()``) walks every frozen object, so it is asked only for a large pass
    (more than :data:`_PROMOTE_ABOVE` young objects), where the collection saved costs more.
    """
    if gc.get_count()[0] > _PROMOTE_ABOVE and gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class _LazyBlockContext:
    """``with block:`` entered on demand, for one sweep.

    A function's own block, once entered, stays entered until the run ends (``_Run.close``): every
    exit walks the whole block (coremltools propagates non-replaceable variables), so a pass whose
    sub-passes all rewrite pays for it once. A nested block is entered for one sweep at a time, above it.
    """

    def __init__(self, run: _Run, block: Block) -> None:
        self.run = run
        self.block = block
        self.entered = False

    def enter(self) -> None:
        if self.entered or self.run.open_block is self.block:
            return
        if self.block.outer_op is None:  # a function: keep it open for the rest of the run
            self.run.close()
            self.block.__enter__()
            self.run.open_block = self.block
            return
        self.block.__enter__()
        self.entered = True

    def __enter__(self) -> _LazyBlockContext:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.entered:
            self.run.keep_block(self.block)
            self.block.__exit__(*exc)


@dataclass
class _Changes:
    """The ops a sub-pass's rewrites created, removed and rewired, in the order they happened.

    Only these can take part in a match that did not exist before (see :func:`_revisit`), and only
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
        :func:`_remove_dead` listed them); ``removed_by_transform``: the ops the transform removed."""
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
                    _check_op(op)


def _live(block: Block) -> bool:
    """Whether ``block`` is still part of the program (not removed with its op by a rewrite)."""
    return block.outer_op is None or block.outer_op.enclosing_block is not None


def _sweep(
    run: _Run, sub: SubPass, st: _BlockState, stats: PassStats, context: _LazyBlockContext, *, first: bool
) -> None:
    """One sub-pass over one block, then over what its rewrites touched, until nothing changes there.

    ``first``: the first round tries every anchor candidate of the block; otherwise the block is
    revisited from the seeds other blocks' rewrites left in it. Each match found is offered to the
    constraints and the transform *inside* the search (:func:`_offer`): one they turn down lets the search
    go on to the next structural match at the same anchor op. ``context`` enters the block's builder
    context before the first transform only, so sub-passes that rewrite nothing never pay for it (see
    :class:`_LazyBlockContext`).
    """
    matcher = sub.matcher
    block = st.block
    if first:
        found = st.anchor_candidates(matcher)
        if found is None:
            return
        anchor, candidates = found
        extra: list[tuple[Operation, int]] = []
    else:
        if not st.possible(matcher):
            run.changes.take(block)
            return
        anchor = matcher.choose_anchor(st.counts)
        candidates, extra = _revisit(run.changes.take(block), block, matcher, anchor)
    accept, last = _offer(run, sub, st, stats, context)
    match_at = matcher.match_at
    order = st.order
    rounds = run.rounds
    attempts = 0
    try:
        while candidates or extra:
            rounds[id(block)] = done = rounds.get(id(block), 0) + 1
            stats.iterations += 1
            if done > sub.max_iterations:
                ops = ", ".join(op.name for op in last[0].op_list()) if last else "?"
                run.restore()
                raise FixpointError(
                    f"Pass {run.pass_name!r}, pattern {sub.name!r}: still rewriting after "
                    f"{sub.max_iterations} rounds (last match: [{ops}]). Its transform re-creates the "
                    f"pattern it replaces; make the replacement differ from the pattern, or raise "
                    f"max_iterations. The program was restored to its state before the pass."
                )
            for op in candidates:
                if op.enclosing_block is block:
                    attempts += 1
                    match_at(op, block, anchor, order=order, accept=accept)
            for op, at in extra:
                if op.enclosing_block is block:
                    attempts += 1
                    match_at(op, block, at, order=order, accept=accept)
            candidates, extra = _revisit(run.changes.take(block), block, matcher, anchor)
    finally:
        stats.attempts += attempts


def _offer(
    run: _Run, sub: SubPass, st: _BlockState, stats: PassStats, context: _LazyBlockContext
) -> tuple[Callable[[Pattern], Any], list[Pattern]]:
    """The ``accept`` of the driver's searches in one block: constraints, then the transform.

    Returns:
        The function, and a list that holds the last match rewritten (for the fixpoint message).
    """
    constraints = sub.var_constraints
    last: list[Pattern] = []

    def accept(match: Pattern) -> Any:
        stats.matches += 1
        if constraints is not None:
            reason = _rejection(run, sub, match)
            if reason is not None:
                stats.rejected += 1
                stats.rejections[reason] += 1
                return reason
        context.enter()
        if not _rewrite(run, sub, st, match):
            stats.declined += 1
            return "transform declined"
        stats.rewrites += 1
        last[:] = [match]
        return True

    return accept, last


def _revisit(
    seeds: list[Operation], block: Block, matcher: Matcher, anchor: int
) -> tuple[list[Operation], list[tuple[Operation, int]]]:
    """The anchor candidates a round of rewrites may have made matchable.

    A match that did not exist before the round contains an op whose inputs or whose outputs' users
    changed: a created op, a rewired op, or the producer of a removed op's input. Only those of the
    pattern's op types can be in a match (:attr:`_Changes.seeds`), so when there is none (a GELU fusion
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
    candidates = _near(seeds, block, matcher.nodes[anchor].op_types, matcher.radius[anchor])
    extra: list[tuple[Operation, int]] = []
    if matcher.joins_through_roots:
        by_type = matcher.anchors_by_type
        extra = [(op, at) for op in seeds for at in by_type.get(op.op_type, ()) if at != anchor]
    return candidates, extra


def _check_op(op: Operation) -> None:
    """The invariants of :meth:`_Changes.validate` for one op still in a block."""
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


def _inconsistent(run: _Run, sub: SubPass, exc: Exception) -> PassExecutionError:
    """Restores the program; the error for a validation that failed after ``sub``'s rewrites."""
    run.restore()
    return PassExecutionError(
        f"Pass {run.pass_name!r}, pattern {sub.name!r}: the program is inconsistent after its rewrites: "
        f"{exc}. The program was restored to its state before the pass."
    )


def constraint_verdict(result: Any) -> str | None:
    """What a ``var_constraints`` result says: None to accept, else the reason for turning the match down.

    A constraint accepts with any true value; it refuses with a false value (``False``, ``None``), with a
    ``(False, "reason")`` pair, or with a string, which is the reason itself (``"rank 3, not 2"``).
    """
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str):
        if result[0]:
            return None
        result = result[1]  # the reason
    if isinstance(result, str):
        return f"constraint returned False: {result}" if result else "constraint returned False"
    return None if result else "constraint returned False"


def _rejection(run: _Run, sub: SubPass, match: Pattern) -> str | None:
    try:
        return constraint_verdict(sub.var_constraints(match))  # type: ignore[misc]
    except Exception as exc:
        raise run.fail(sub, "var_constraints", match, exc) from exc


def _rewrite(run: _Run, sub: SubPass, st: _BlockState, match: Pattern) -> bool:
    """Runs the transform and removes the matched ops it left dead; False if it declined.

    A transform declines by returning False before changing anything. One that returns anything else
    must have rewritten the match: a transform that inserted and removed nothing (the framework's removal
    of dead matched ops included), or that only built ops nothing uses while every matched op stayed, is
    an error naming the missing ``replace_output`` (it would otherwise be retried until the fixpoint cap).
    """
    if run.journal is None:
        run.journal = Journal(run.blocks, run.ops_at_start)  # nothing was rewritten before
    st.observe()
    block = st.block
    matched = match.op_set
    outside_users = [user for var in match.output_vars() for user in var._child_ops if user not in matched]
    run.journal.keep_match(matched)
    n_inserted, n_removed = len(st.inserted), len(st.removed)
    before = -1 if st.observed else len(block.operations)  # an unobservable op list: count the ops
    try:
        result = sub.transform_pattern(match)
    except Exception as exc:
        raise run.fail(sub, "transform_pattern", match, exc) from exc
    if result is False:
        if _changed_structure(st, n_inserted, n_removed, before):
            raise run.fail(
                sub,
                "transform_pattern",
                match,
                RuntimeError("it returned False (declined) after changing the program"),
            )
        return False
    n_removed_by_transform = len(st.removed)
    dead = _remove_dead(match)
    if not _changed_structure(st, n_inserted, n_removed, before):
        raise run.refuse(sub, match, f"returned {result!r} without changing the program (no op inserted "
                         f"or removed)", _REPLACE_OUTPUT + " To leave a match as it is, return False.")
    created = st.inserted[n_inserted:]
    if not dead and n_removed_by_transform == n_removed and created and not _used(created):
        names = ", ".join(op.name for op in created)
        raise run.refuse(sub, match, f"built [{names}] but nothing uses them and every matched op is still "
                         f"in place", _REPLACE_OUTPUT)
    run.changes.record(
        sub.seed_types,
        created=created,
        dead=dead,
        removed_by_transform=st.removed[n_removed:n_removed_by_transform],
        rewired=outside_users,
    )
    if run.validate and run.validate != "full":
        try:
            run.changes.validate()
        except Exception as exc:
            raise _inconsistent(run, sub, exc) from exc
    if tracing.recording:  # a trace is open (pattern_infra.trace): one flag test otherwise
        tracing.record(run.prog, run.pass_name, sub.name, block, match.op_list(), created, st.removed[n_removed:])
    return True


_REPLACE_OUTPUT = (
    "Call pattern.replace_output(new_var) (or replace_outputs) to redirect the match's users to the "
    "replacement; the framework then removes the matched ops."
)


def _used(ops: list[Operation]) -> bool:
    """Whether an output of one of ``ops`` is read by an op or returned by a block."""
    return any(var._child_ops or var.consuming_blocks for op in ops for var in op._output_vars)


def _changed_structure(st: _BlockState, n_inserted: int, n_removed: int, before: int) -> bool:
    """Whether ops were inserted into or removed from ``st``'s block since the counts were taken
    (``before``: the op count, for a block whose op list cannot be observed; else -1)."""
    if len(st.inserted) != n_inserted or len(st.removed) != n_removed:
        return True
    return before >= 0 and len(st.block.operations) != before


def remove_dead_ops(match: Pattern) -> list[Operation]:
    """Removes the matched ops still in the block whose outputs nothing uses.

    This is what lets a transform only build the replacement and redirect the outputs: the framework
    deletes what the replacement made dead. The ops are visited consumers first (the pattern's own
    order, reversed), so a chain of matched ops dies in one visit. An op is dead when no output is a
    block output (``consuming_blocks``) or read by an op outside the dead ones: what
    ``Block.remove_ops`` checks, so the ops are then unlinked directly (:func:`_unlink`), the same end
    state as ``Block.remove_ops`` at about two thirds of its cost.

    Returns:
        The removed ops.
    """
    return [op for op, _ in _remove_dead(match)]


def _remove_dead(match: Pattern) -> list[tuple[Operation, list[Var]]]:
    """:func:`remove_dead_ops`, returning each removed op with the variables it read."""
    block = match.block
    dead: set[Operation] = set()
    order: list[Operation] = []
    for op in match._reverse_topological():
        if op.enclosing_block is not block:
            continue
        for var in op._output_vars:
            if var.consuming_blocks or not dead.issuperset(var._child_ops):
                break
        else:
            dead.add(op)
            order.append(op)
    return _unlink(block, order) if order else []


def _unlink(block: Block, ops: list[Operation]) -> list[tuple[Operation, list[Var]]]:
    """Takes ``ops``, dead ops of ``block`` (no output used outside ``ops``, none a block output), out of
    the block: what ``Block.remove_ops`` does to them, without its checks, which ``remove_dead_ops`` made
    already, and without its copies (``get_flattened_inputs``, ``set(ops)``): about a third of its cost.
    Ops with nested blocks or internal inputs, and a block whose op list is not coremltools' linked list,
    go through ``Block.remove_ops``. Each open journal records the removal (:meth:`Journal.unlinked`:
    the op's block and its inputs' user lists), since the hooked ``Var.remove_child_op`` is bypassed."""
    removal = [(op, flat_inputs(op)) for op in ops]
    ops_list = block.operations
    if type(ops_list) is not CacheDoublyLinkedList and not isinstance(ops_list, CacheDoublyLinkedList):
        block.remove_ops(ops)
        return removal
    for op in ops:
        if op.blocks:
            block.remove_ops(ops)
            return removal
        for value in op._input_vars.values():
            if isinstance(value, InternalVar):
                block.remove_ops(ops)
                return removal
    for journal in journals_on_this_thread():
        journal.unlinked(block, removal)
    for op, inputs in removal:
        ops_list.remove(op)
        op.enclosing_block = None
        for var in inputs:
            var._child_ops.remove(op)
    return removal


def _near(seeds: list[Operation], block: Block, anchor_types: frozenset[str], radius: int) -> list[Operation]:
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


def distinct_matches(
    var_constraints: Constraints | None,
    on_match: Callable[[Pattern], Any],
    on_refusal: Callable[[Pattern, str], Any] | None = None,
) -> Callable[[Pattern], str]:
    """An ``accept`` that takes no match, so a search enumerates every one, and hands each distinct set
    of program ops the constraints accept to ``on_match`` once (with its first accepted assignment).

    A set refused under one assignment (operand order) is offered again under the next; each refusal goes
    to ``on_refusal`` with its reason. Shared by :func:`find_in_program` and ``explain``.
    """
    seen: set[frozenset[int]] = set()

    def collect(match: Pattern) -> str:
        key = frozenset(id(o) for o in match.op_set)
        if key in seen:
            return "already found"
        if var_constraints is not None:
            reason = constraint_verdict(var_constraints(match))
            if reason is not None:
                if on_refusal is not None:
                    on_refusal(match, reason)
                return reason
        seen.add(key)
        on_match(match)
        return "collected"  # not taken: the search goes on to the next match

    return collect


def find_in_program(
    prog: Program,
    matcher: Matcher,
    var_constraints: Constraints | None = None,
) -> Iterator[Pattern]:
    """Yields every match of ``matcher``'s pattern in ``prog``, lazily, without changing it.

    One match per distinct set of program ops: every structural match at each anchor candidate is
    offered to ``var_constraints`` (a refused one lets the search go on), and a set of ops already
    yielded is skipped. Blocks are visited outer first, anchor ops in program order; matches may overlap.
    """
    for block in iter_blocks(prog):
        st = _BlockState(block)
        found = st.anchor_candidates(matcher)
        if found is None:
            continue
        anchor, candidates = found
        here: list[Pattern] = []
        collect = distinct_matches(var_constraints, here.append)

        for op in candidates:
            if op.enclosing_block is block:
                matcher.match_at(op, block, anchor, order=st.order, accept=collect)
                yield from here
                here.clear()
