"""Apply compiled patterns to a program in time linear in its size, and lose nothing on failure.

Owns the run of a pass: the worklist of blocks and sub-passes, the sweep and its revisits, offering each
match to the constraints and the transform, the undo journal's opening and the errors. What it uses:
:mod:`~pattern_infra.blocks` (the block index and the anchor loop), :mod:`~pattern_infra.changes` (what
rewrites changed: seeds and validation), :mod:`~pattern_infra.removal` (dead matched ops),
:mod:`~pattern_infra.journal` (undo).

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
   :func:`remove_dead_ops`). What the rewrite did is recorded as :class:`Changes`: the ops created, the
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
   (see :meth:`Changes.validate`).
5. A block's builder context (``with block:``) is entered only when a rewrite needs it, and a
   function's block stays entered for the rest of the run; cyclic GC is paused during the run. A
   sub-pass whose op types are not all present in some block costs one check per block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program

from .blocks import BlockIndex, LazyBlockContext, is_live, walk_blocks
from .changes import Changes, broken_contract, read_only_constants, returned_names, revisit_candidates
from .errors import FixpointError, PassExecutionError, PatternInfraError
from .gc_pause import paused_gc
from .journal import Journal
from .pattern import Pattern
from .removal import remove_dead
from .subpass import PassStats, SubPass, constraint_verdict
from . import tracing

__all__ = ["run_subpasses"]



class _Run:
    """One application of a group of sub-passes to a program."""

    def __init__(self, prog: Program, pass_name: str, validate: bool | str) -> None:
        self.prog = prog
        self.pass_name = pass_name
        self.validate = validate
        self.journal: Journal | None = None
        """Opened before the first transform runs (see :mod:`pattern_infra.journal`)."""
        walked = list(walk_blocks(prog))
        self.blocks: list[Block] = [block for block, _ in walked]
        """Every block, listed once at the start (nothing changes before the journal opens)."""
        self.ops_at_start: dict[int, list[Operation]] = {id(block): ops for block, ops in walked}
        """Each block's ops as listed at the start, for its index while nothing has been rewritten."""
        self.states: dict[int, BlockIndex] = {}
        self.log: dict[str, list[Operation]] | None = None
        """Every op a rewrite of any sub-pass created, rewired or left with fewer users, by type: what
        the other sub-passes of its pass revisit (:func:`_revisit_earlier`). None while the sub-passes
        running have no other to revisit their changes."""
        self.changes = Changes()
        """What the current sub-pass's rewrites did, for the revisits and the validation."""
        self.rounds: dict[int, int] = {}
        """Per block (by id), the rounds the current sub-pass has swept it: the fixpoint cap."""
        self.open_block: Block | None = None

    def precedes(self, block: Block, first: Operation, second: Operation) -> bool:
        """Whether ``first`` stands before ``second`` in ``block`` (see :meth:`BlockIndex.precedes`)."""
        return self.state(block).precedes(first, second)

    def close(self) -> None:
        """Leaves the function block kept open by :class:`~pattern_infra.blocks.LazyBlockContext`, if any."""
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

    def state(self, block: Block) -> BlockIndex:
        st = self.states.get(id(block))
        if st is None:
            ops = self.ops_at_start.get(id(block)) if self.journal is None else None
            st = BlockIndex(block, ops)
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
    passes: Sequence[str] | None = None,
) -> PassStats:
    """Applies each sub-pass, in order, to every block of ``prog``.

    Args:
        prog: The program, changed in place.
        subpasses: The sub-passes, already in run order.
        pass_name: Pass id, for messages and traces.
        validate: ``True`` checks the invariants of coremltools' ``Block.validate`` on the ops each
            rewrite created or rewired, right after it (linear in what changed); ``"full"`` validates
            the whole program after each sub-pass that rewrote; ``False`` skips it. coremltools'
            pipeline validates the whole program after every pass anyway.
        passes: For several passes applied in one call, the id of the pass each sub-pass belongs to
            (consecutive sub-passes of one pass share it; messages and traces name it). Each pass
            reaches its own fixpoint (its sub-passes revisit each other's changes) before the next one
            starts, as when they run one by one. None: all sub-passes form the pass ``pass_name``.

    Returns:
        The counters of this run, summed over the sub-passes.

    Raises:
        PassExecutionError: A callback raised; the program is as it was before the call.
        FixpointError: A sub-pass kept re-creating its pattern; the program is as it was before.
    """
    run = _Run(prog, pass_name, validate)
    total = PassStats()
    with paused_gc():
        _run_groups(run, _groups(subpasses, pass_name, passes), total)
    return total


def _run_groups(run: _Run, groups: list[tuple[str, list[SubPass]]], total: PassStats) -> None:
    """The body of :func:`run_subpasses`: each pass's sub-passes, then their revisits of each other."""
    try:
        blocks = run.blocks
        for name, group in groups:
            run.pass_name = name
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
            f"Pass {run.pass_name!r} failed while rewriting: {type(exc).__name__}: {exc}. The program "
            f"was restored to its state before the pass."
        ) from exc
    finally:
        run.close_journal()  # first: leaving the function block rewrites every variable of it
        run.close()
        run.release()
        run.journal = None  # its saved states are freed here, by reference counting


def _groups(
    subpasses: list[SubPass], pass_name: str, passes: Sequence[str] | None
) -> list[tuple[str, list[SubPass]]]:
    """The sub-passes cut into runs of one pass each, with its id (see ``run_subpasses``' ``passes``)."""
    if passes is None:
        return [(pass_name, subpasses)] if subpasses else []
    if len(passes) != len(subpasses):
        raise ValueError(f"passes names {len(passes)} sub-passes, but {len(subpasses)} were given")
    groups: list[tuple[str, list[SubPass]]] = []
    for i, sub in enumerate(subpasses):
        if i == 0 or passes[i] != passes[i - 1]:
            groups.append((passes[i], []))
        groups[-1][1].append(sub)
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
            if is_live(block):
                with LazyBlockContext(run, block) as context:
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
    run.changes = Changes(log=run.log)
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
            if not any(run.state(block).possible(sub.matcher) for block in run.blocks if is_live(block)):
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


def _sweep(
    run: _Run, sub: SubPass, st: BlockIndex, stats: PassStats, context: LazyBlockContext, *, first: bool
) -> None:
    """One sub-pass over one block, then over what its rewrites touched, until nothing changes there.

    ``first``: the first round tries every anchor candidate of the block; otherwise the block is
    revisited from the seeds other blocks' rewrites left in it. Each match found is offered to the
    constraints and the transform *inside* the search (:func:`_offer`): one they turn down lets the search
    go on to the next structural match at the same anchor op. ``context`` enters the block's builder
    context before the first transform only, so sub-passes that rewrite nothing never pay for it (see
    :class:`LazyBlockContext`).
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
        candidates, extra = revisit_candidates(run.changes.take(block), block, matcher, anchor)
    accept, last = _offer(run, sub, st, stats, context)
    tries = st.tries
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
            for _ in tries(matcher, anchor, candidates, accept):
                attempts += 1
            for op, at in extra:  # a seed tried as another pattern op of its type
                for _ in tries(matcher, at, (op,), accept):
                    attempts += 1
            candidates, extra = revisit_candidates(run.changes.take(block), block, matcher, anchor)
    finally:
        stats.attempts += attempts


def _offer(
    run: _Run, sub: SubPass, st: BlockIndex, stats: PassStats, context: LazyBlockContext
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


def _inconsistent(run: _Run, sub: SubPass, exc: Exception) -> PassExecutionError:
    """Restores the program; the error for a validation that failed after ``sub``'s rewrites."""
    run.restore()
    return PassExecutionError(
        f"Pass {run.pass_name!r}, pattern {sub.name!r}: the program is inconsistent after its rewrites: "
        f"{exc}. The program was restored to its state before the pass."
    )


def _rejection(run: _Run, sub: SubPass, match: Pattern) -> str | None:
    try:
        return constraint_verdict(sub.var_constraints(match))  # type: ignore[misc]
    except Exception as exc:
        raise run.fail(sub, "var_constraints", match, exc) from exc


def _rewrite(run: _Run, sub: SubPass, st: BlockIndex, match: Pattern) -> bool:
    """Runs the transform and removes the matched ops it left dead; False if it declined.

    A transform declines by returning False before changing anything. One that returns anything else
    must have rewritten the match: a transform that inserted and removed nothing (the framework's removal
    of dead matched ops included) is an error naming the missing ``replace_output`` (it would otherwise be
    retried until the fixpoint cap). Then the rewrite's contract is checked on the ops it touched
    (:func:`~pattern_infra.changes.broken_contract`: every new op used, each before its users, the
    block's outputs kept); a breach restores the program and names the fix. The constants the match
    reads are read-only while the transform runs (the journal does not copy tensors).
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
    returned = returned_names(block)
    frozen = read_only_constants(matched)  # the journal copies no tensor: writing into one must raise
    try:
        result = sub.transform_pattern(match)
    except Exception as exc:
        if frozen and isinstance(exc, ValueError) and "read-only" in str(exc):
            raise run.refuse(sub, match, f"wrote into a constant in place ({exc})", _NEW_CONSTANT) from exc
        raise run.fail(sub, "transform_pattern", match, exc) from exc
    finally:
        for value in frozen:
            value.flags.writeable = True
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
    dead = remove_dead(match)
    if not _changed_structure(st, n_inserted, n_removed, before):
        raise run.refuse(sub, match, f"returned {result!r} without changing the program (no op inserted "
                         f"or removed)", _REPLACE_OUTPUT + " To leave a match as it is, return False.")
    created = st.inserted[n_inserted:]
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
    breach = broken_contract(created, outside_users, block, returned, run.precedes, match.replacements())
    if breach is not None:
        raise run.refuse(sub, match, *breach)
    if tracing.recording:  # a trace is open (pattern_infra.trace): one flag test otherwise
        tracing.record(run.prog, run.pass_name, sub.name, block, match.op_list(), created, st.removed[n_removed:])
    return True


_REPLACE_OUTPUT = (
    "Call pattern.replace_output(new_var) (or replace_outputs) to redirect the match's users to the "
    "replacement; the framework then removes the matched ops."
)

_NEW_CONSTANT = (
    "Build a new constant for the new value (mb.const(val=..., before_op=...)): a program constant may "
    "be read by other ops, and the undo journal does not copy tensors."
)


def _changed_structure(st: BlockIndex, n_inserted: int, n_removed: int, before: int) -> bool:
    """Whether ops were inserted into or removed from ``st``'s block since the counts were taken
    (``before``: the op count, for a block whose op list cannot be observed; else -1)."""
    if len(st.inserted) != n_inserted or len(st.removed) != n_removed:
        return True
    return before >= 0 and len(st.block.operations) != before


