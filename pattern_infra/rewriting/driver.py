"""Apply compiled patterns to a program in time linear in its size, and lose nothing on failure.

How ``run_subpasses`` runs a group of sub-passes:

1. Every block, nested ones included, is listed once and its ops indexed by type (:mod:`.blocks`);
   the op list is observed for the run, so inserted ops join the index and changes are recorded.
2. Per sub-pass and block, only ops of the rarest pattern op type are tried as anchors. Each match is
   offered, inside the search, to the constraints then the transform (:func:`_offer`); one they turn
   down lets the search go on. Matched ops left unused are removed (:mod:`.removal`).
3. Nothing is rescanned: only anchor candidates near what a rewrite changed are tried again
   (:mod:`.changes`); past ``max_iterations`` rounds, :class:`FixpointError`. Each sub-pass then
   revisits what the later ones changed (:func:`_revisit_earlier`) until a round rewrites nothing.
4. An undo journal (:mod:`.journal`) opens before the first transform. If a callback raises or a
   validation fails, the program is restored as it was and :class:`PassExecutionError` says why.
5. A block's builder context is entered only when a rewrite needs it; cyclic GC is paused for the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program

from .blocks import BlockIndex, LazyBlockContext, is_live, walk_blocks
from .changes import Changes, revisit_candidates
from .contract import broken_contract, read_only_constants, returned_names
from ..language.errors import FixpointError, PassExecutionError, PatternInfraError
from .gc_pause import paused_gc
from .journal import Journal
from ..language.pattern import Pattern
from .removal import remove_dead
from .subpass import PassStats, SubPass, constraint_verdict

__all__ = ["run_subpasses"]

_RESTORED = "The program was restored to its state before the pass."


class _Run:
    """One application of a group of sub-passes to a program."""

    def __init__(self, prog: Program, pass_name: str, validate: bool | str) -> None:
        self.prog, self.pass_name, self.validate = prog, pass_name, validate
        self.journal: Journal | None = None  # opened before the first transform runs
        walked = list(walk_blocks(prog))
        self.blocks: list[Block] = [block for block, _ in walked]
        self.ops_at_start: dict[int, list[Operation]] = {id(block): ops for block, ops in walked}
        """Each block's ops at the start, for its index while nothing has been rewritten."""
        self.states: dict[int, BlockIndex] = {}
        self.log: dict[str, list[Operation]] | None = None
        """Ops the rewrites changed, by type, for the other sub-passes to revisit (None: no other one)."""
        self.changes = Changes()  # what the current sub-pass's rewrites did
        self.rounds: dict[int, int] = {}  # per block id, the current sub-pass's sweeps: the fixpoint cap
        self.open_block: Block | None = None

    def precedes(self, block: Block, first: Operation, second: Operation) -> bool:
        """Whether ``first`` stands before ``second`` in ``block`` (see :meth:`BlockIndex.precedes`)."""
        return self.state(block).precedes(first, second)

    def close(self) -> None:
        """Leaves the function block kept open by :class:`LazyBlockContext`, if any."""
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
        """The index of ``block``, made on first use."""
        st = self.states.get(id(block))
        if st is None:
            ops = self.ops_at_start.get(id(block)) if self.journal is None else None
            st = self.states[id(block)] = BlockIndex(block, ops)
        return st

    def fail(self, sub: SubPass, what: str, match: Pattern, exc: BaseException) -> PassExecutionError:
        """Restores the program (first: the message names the ops as they were); the error for a callback."""
        note = _RESTORED if self.restore() else "The program had not been changed yet."
        ops = ", ".join(f"{op.name} ({op.op_type})" for op in match.op_list())
        return PassExecutionError(f"Pass {self.pass_name!r}, pattern {sub.name!r}: {what} raised "
                                  f"{type(exc).__name__}: {exc}, on the match [{ops}]. {note}")

    def refuse(self, sub: SubPass, match: Pattern, problem: str, fix: str) -> PassExecutionError:
        """Restores the program; the error for a transform that broke the rules without raising."""
        note = f" {_RESTORED}" if self.restore() else ""
        ops = ", ".join(f"{op.name} ({op.op_type})" for op in match.op_list())
        return PassExecutionError(f"Pass {self.pass_name!r}, pattern {sub.name!r}: on the match [{ops}], "
                                  f"transform_pattern {problem}. {fix}{note}")

    def restore(self) -> bool:
        """Puts the program back as it was before the pass; False if nothing had been changed."""
        self.release()
        if self.journal is not None:
            self.journal.restore()
        return self.journal is not None

    def release(self) -> None:
        for st in self.states.values():
            st.release()

    def close_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()


def run_subpasses(
    prog: Program, subpasses: list[SubPass], pass_name: str, *, validate: bool | str = True,
    passes: Sequence[str] | None = None,
) -> PassStats:
    """Applies each sub-pass, in order, to every block of ``prog``.

    Args:
        prog: The program, changed in place.
        subpasses: The sub-passes, already in run order.
        pass_name: Pass id, for messages and traces.
        validate: ``True`` checks ``Block.validate``'s invariants on what each rewrite changed;
            ``"full"`` validates the program after each sub-pass that rewrote; ``False`` neither.
        passes: The pass id of each sub-pass, to run several passes in one call, each reaching its
            fixpoint before the next starts. None: all sub-passes form the pass ``pass_name``.

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
        for name, group in groups:
            run.pass_name = name
            seen: list[dict[str, int]] = []
            run.log = {} if len(group) > 1 else None
            run.changes.log = run.log
            for sub in group:
                if any(run.state(block).possible(sub.matcher) for block in run.blocks):
                    total.add(_apply(run, sub, first=True))
                else:
                    sub.stats.runs += 1  # no block holds every op type of the pattern
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
            f"Pass {run.pass_name!r} failed while rewriting: {type(exc).__name__}: {exc}. {_RESTORED}"
        ) from exc
    finally:
        run.close_journal()  # first: leaving the function block rewrites every variable of it
        run.close()
        run.release()
        run.journal = None  # its saved states are freed here, by reference counting


def _groups(subpasses: list[SubPass], pass_name: str, passes: Sequence[str] | None) -> list[tuple[str, list[SubPass]]]:
    """The sub-passes cut into runs of one pass each, with its id (see ``run_subpasses``' ``passes``)."""
    if passes is None:
        return [(pass_name, subpasses)] if subpasses else []
    if len(passes) != len(subpasses):
        raise ValueError(f"passes names {len(passes)} sub-passes, but {len(subpasses)} were given")
    return [(name, [sub for _, sub in run]) for name, run in groupby(zip(passes, subpasses), key=itemgetter(0))]


def _apply(run: _Run, sub: SubPass, *, first: bool) -> PassStats:
    """One sub-pass over every block (``first``) or the blocks with seeds, until none has seeds left
    (a rewrite may free a match in another block)."""
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
    """Lets each sub-pass revisit the logged ops of its types the others changed after it ran, until a
    round rewrites nothing."""
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
        f"({', '.join(sub.name for sub in subpasses)}); make each replacement differ from the other "
        f"patterns. {_RESTORED}"
    )


def _sweep(run: _Run, sub: SubPass, st: BlockIndex, stats: PassStats, context: LazyBlockContext, *,
           first: bool) -> None:
    """One sub-pass over one block (every anchor candidate if ``first``, else from the block's seeds),
    then over what its rewrites touched, until nothing changes there."""
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
                    f"max_iterations. {_RESTORED}"
                )
            for _ in tries(matcher, anchor, candidates, accept):
                attempts += 1
            for op, at in extra:  # a seed tried as another pattern op of its type
                for _ in tries(matcher, at, (op,), accept):
                    attempts += 1
            candidates, extra = revisit_candidates(run.changes.take(block), block, matcher, anchor)
    finally:
        stats.attempts += attempts


def _offer(run: _Run, sub: SubPass, st: BlockIndex, stats: PassStats,
           context: LazyBlockContext) -> tuple[Callable[[Pattern], Any], list[Pattern]]:
    """The ``accept`` of the driver's searches in one block (constraints, then the transform), and a list
    holding the last match rewritten (for the fixpoint message)."""
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
    return PassExecutionError(f"Pass {run.pass_name!r}, pattern {sub.name!r}: the program is inconsistent after "
                              f"its rewrites: {exc}. {_RESTORED}")


def _rejection(run: _Run, sub: SubPass, match: Pattern) -> str | None:
    try:
        return constraint_verdict(sub.var_constraints(match))  # type: ignore[misc]
    except Exception as exc:
        raise run.fail(sub, "var_constraints", match, exc) from exc


def _rewrite(run: _Run, sub: SubPass, st: BlockIndex, match: Pattern) -> bool:
    """Runs the transform and removes the matched ops it left dead; False if it declined.

    A transform declines by returning False before changing anything. Any other result must come with a
    rewrite: inserting and removing nothing is an error naming the missing ``replace_output``. Then the
    rewrite's contract is checked on the ops it touched (:func:`~.changes.broken_contract`: every new op
    used, each before its users, the block's outputs kept); a breach restores the program and names the
    fix. The constants the match reads are read-only while the transform runs.
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
    if rewrite_listeners:  # a trace is open (pattern_infra.trace)
        for listener in rewrite_listeners:
            listener(run.prog, run.pass_name, sub.name, block, match.op_list(), created, st.removed[n_removed:])
    return True


rewrite_listeners: list[Callable[..., None]] = []
"""Called after each rewrite with (program, pass id, pattern name, block, matched ops, created ops,
removed ops): :func:`pattern_infra.trace` registers one while a trace is open."""

_REPLACE_OUTPUT = ("Call pattern.replace_output(new_var) (or replace_outputs) to redirect the match's users to "
                   "the replacement; the framework then removes the matched ops.")

_NEW_CONSTANT = (
    "Build a new constant for the new value (mb.const(val=..., before_op=...)): a program constant may "
    "be read by other ops, and the undo journal does not copy tensors."
)


def _changed_structure(st: BlockIndex, n_inserted: int, n_removed: int, before: int) -> bool:
    """Whether ops were inserted into or removed from ``st``'s block since the counts were taken
    (``before``: the op count of an unobserved block, else -1)."""
    if len(st.inserted) != n_inserted or len(st.removed) != n_removed:
        return True
    return before >= 0 and len(st.block.operations) != before
