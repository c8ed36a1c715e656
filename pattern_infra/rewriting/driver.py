"""A pass's run over a program (:func:`run_subpasses`): the op index, sweeps from anchor candidates,
revisits, the rewrite's checks and undo on failure; its steps are in docs/ARCHITECTURE.md, "Rewriting".
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import groupby
from operator import itemgetter
from typing import Any

from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Block, Operation, Program
from coremltools.converters.mil.mil.scope import ScopeInfo

from ..language.errors import FixpointError, PassExecutionError, PatternInfraError
from ..language.pattern import Pattern
from .blocks import BlockIndex, flat_inputs, walk_blocks
from .changes import Changes, revisit_candidates, validate_rewrite
from .contract import USE_THE_NEW_OPS, broken_contract, read_only_constants, returned_names
from .journal import Journal
from .removal import remove_dead
from .subpass import PassStats, SubPass, constraint_verdict

__all__ = ["run_subpasses"]


class _Run:
    """One application of a group of sub-passes to a program."""

    def __init__(self, prog: Program, validate: bool | str) -> None:
        self.prog, self.validate = prog, validate
        self.pass_name = ""
        self.journal: Journal | None = None  # opened before the first transform runs
        self.ops_at_start: dict[Block, list[Operation]] = dict(walk_blocks(prog))
        """Each block (outer blocks first) with its ops at the start, its index while nothing is rewritten."""
        self.blocks: list[Block] = list(self.ops_at_start)
        self.states: dict[Block, BlockIndex] = {}
        self.changes = Changes()  # the current sub-pass's seeds, and the log of the pass's sub-passes
        self.rounds: dict[Block, int] = {}  # per block, the current sub-pass's sweeps: the fixpoint cap
        self.entered: list[Block] = []  # the blocks whose builder context is entered, innermost last

    def state(self, block: Block) -> BlockIndex:
        """The index of ``block``, made on first use."""
        st = self.states.get(block)
        if st is None:
            ops = self.ops_at_start.get(block) if self.journal is None else None
            st = self.states[block] = BlockIndex(block, ops)
        return st

    def enter(self, block: Block) -> None:
        """Enters ``block``'s builder context for a rewrite in it, a function's until the run ends (leaving
        it walks the whole block), a nested block's until the sweep over it ends."""
        if self.entered and self.entered[-1] is block:
            return
        if block.outer_op is None:
            self.leave(nested_only=False)
        block.__enter__()
        self.entered.append(block)

    def leave(self, *, nested_only: bool) -> None:
        """Leaves the entered nested block (``nested_only``) or every entered block, saving first the
        variables ``Block.__exit__`` rewrites while the journal is open."""
        entered = self.entered
        while entered and not (nested_only and entered[-1].outer_op is None):
            block = entered.pop()
            if self.journal is not None and not self.journal.closed:
                self.journal.keep_block(block)
            block.__exit__(None, None, None)

    def error(
        self,
        sub: SubPass | None,
        text: str,
        match: Pattern | None = None,
        fix: str = "",
        kind: type[PatternInfraError] = PassExecutionError,
    ) -> PatternInfraError:
        """Restores the program; the error saying ``text`` about ``sub`` (None: about the pass), then the ops
        of ``match`` as restored (a transform may have renamed them), then ``fix``."""
        note = "The program had not been changed yet."
        if self.journal is not None:
            self.journal.restore()
            note = "The program was restored to its state before the pass."
        where = f"Pass {self.pass_name!r}" + ("" if sub is None else f", pattern {sub.name!r}")
        if match is not None:
            text += f", on the match [{', '.join(f'{op.name} ({op.op_type})' for op in match.op_list())}]."
        return kind(" ".join(part for part in (f"{where}: {text}", fix, note) if part))


def run_subpasses(
    prog: Program,
    subpasses: list[SubPass],
    pass_name: str,
    *,
    validate: bool | str = True,
    passes: Sequence[str] | None = None,
    scopes: Mapping[str, ScopeInfo] | None = None,
    stats: Sequence[PassStats] | None = None,
) -> PassStats:
    """Applies each sub-pass in order to every block of ``prog``, in place, and returns the counters summed.
    ``validate``: True checks what each rewrite changed, ``"full"`` the program after each sub-pass that
    rewrote; ``passes``: each sub-pass's pass id (None: all are ``pass_name``), each pass reaching its
    fixpoint before the next; ``scopes``: each pass's ``mb.scope``; ``stats``: per sub-pass, the counters
    its applications fill (sub-passes may share one), besides its cumulative ``SubPass.stats``.
    On :class:`PassExecutionError` or :class:`FixpointError` the program is as it was before the call."""
    run = _Run(prog, validate)
    total = PassStats()
    filled = stats or [PassStats() for _ in subpasses]
    named = zip(passes or [pass_name] * len(subpasses), zip(subpasses, filled, strict=True), strict=True)
    with _paused_gc():
        try:
            for name, pairs in groupby(named, key=itemgetter(0)):
                run.pass_name = name
                with mb.scope(*[scopes[name]] if scopes and name in scopes else []):
                    _run_pass(run, [entry for _, entry in pairs], total)
        except PatternInfraError:
            raise
        except Exception as exc:  # an error of coremltools' own while applying the rewrite
            raise run.error(None, f"failed while rewriting: {type(exc).__name__}: {exc}.") from exc
        finally:
            if run.journal is not None:
                run.journal.close()  # first: leaving the function block rewrites every variable of it
            run.leave(nested_only=False)
            for st in run.states.values():
                st.release()
            run.journal = None  # its saved states are freed here, by reference counting
    return total


_PROMOTE_ABOVE = 20_000  # young objects above which a pass's survivors are promoted, not collected


@contextmanager
def _paused_gc() -> Iterator[None]:
    """Cyclic GC off for the ``with`` block, many survivors then promoted unexamined (why and how:
    docs/ARCHITECTURE.md, "Rewriting")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_count()[0] > _PROMOTE_ABOVE and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def _apply(run: _Run, sub: SubPass, into: PassStats, *, first: bool) -> PassStats:
    """One sub-pass over every block (``first``) or the blocks with seeds, until none has seeds left
    (a rewrite may free a match in another block); its counters go to ``into`` and ``sub.stats``."""
    stats = PassStats(runs=1 if first else 0)
    start = time.perf_counter()
    run.rounds = {}
    pending = run.blocks if first else run.changes.pending(run.blocks)
    while pending:
        for block in pending:
            if block.outer_op is not None and block.outer_op.enclosing_block is None:
                continue  # removed with its op
            _sweep(run, sub, run.state(block), stats, first=first)
            run.leave(nested_only=True)
        first = False
        pending = run.changes.pending(run.blocks)
    stats.seconds = time.perf_counter() - start
    sub.stats.add(stats)
    into.add(stats)
    if stats.rewrites and run.validate == "full":  # otherwise each rewrite was checked (_rewrite)
        try:
            run.prog.validate()
        except Exception as exc:
            raise run.error(sub, f"the program is inconsistent after its rewrites: {exc}.") from exc
    return stats


def _run_pass(run: _Run, entries: list[tuple[SubPass, PassStats]], total: PassStats) -> None:
    """Applies each sub-pass to every block (its counters to its stats); with several, each then revisits
    the ops of its types the others changed after it ran (``run.changes.log``), in rounds until one
    rewrites nothing."""
    log = run.changes.log = {} if len(entries) > 1 else None
    seen: list[dict[str, int]] = [{} for _ in entries]  # per sub-pass, how much of the log it has seen
    limit = max(sub.max_iterations for sub, _ in entries)
    for revisit in range(limit + 1):
        rewrites = total.rewrites
        for k, (sub, sub_stats) in enumerate(entries):
            if revisit and log is not None:  # a revisit needs the log (several sub-passes)
                for op_type in sorted(sub.seed_types) if sub.seed_types is not None else list(log):
                    for op in log.get(op_type, ())[seen[k].get(op_type, 0) :]:
                        run.changes.seed(op)
            if not revisit or run.changes.seeds:
                total.add(_apply(run, sub, sub_stats, first=not revisit))
            if log is not None:
                seen[k] = {op_type: len(ops) for op_type, ops in log.items()}
        if log is None or total.rewrites == rewrites:
            return
    raise run.error(
        None,
        f"its sub-passes kept re-creating each other's patterns for {limit} rounds "
        f"({', '.join(sub.name for sub, _ in entries)}); make each replacement differ from the "
        f"other patterns.",
        kind=FixpointError,
    )


def _sweep(run: _Run, sub: SubPass, st: BlockIndex, stats: PassStats, *, first: bool) -> None:
    """One sub-pass over one block (every anchor candidate if ``first``, else from the block's seeds),
    then over what its rewrites touched, until nothing changes there."""
    matcher, block = sub.matcher, st.block
    if first:
        found = st.anchor_candidates(matcher)
        if found is None:
            return
        anchor, searches = found[0], [found]
    elif st.possible(matcher):
        anchor = matcher.choose_anchor(st.counts)
        searches = revisit_candidates(run.changes.take(block), block, matcher, anchor)
    else:
        run.changes.take(block)
        return
    constraints = sub.var_constraints
    last: Pattern | None = None  # the last match rewritten, for the fixpoint message

    def accept(match: Pattern) -> Any:
        nonlocal last
        stats.matches += 1
        if constraints is not None:
            try:
                reason = constraint_verdict(constraints(match))
            except Exception as exc:
                raise run.error(sub, f"var_constraints raised {type(exc).__name__}: {exc}", match) from exc
            if reason is not None:
                stats.rejected += 1
                stats.rejections[reason] += 1
                return reason
        run.enter(block)
        if not _rewrite(run, sub, st, match):
            stats.declined += 1
            return "transform declined"
        stats.rewrites += 1
        last = match
        return True

    rounds = run.rounds
    while searches:
        rounds[block] = done = rounds.get(block, 0) + 1
        stats.iterations += 1
        if done > sub.max_iterations:
            ops = ", ".join(op.name for op in last.op_list()) if last else "?"
            raise run.error(
                sub,
                f"still rewriting after {sub.max_iterations} rounds (last match: [{ops}]). Its "
                f"transform re-creates the pattern it replaces; make the replacement differ "
                f"from the pattern, or raise max_iterations.",
                kind=FixpointError,
            )
        for at, candidates in searches:
            for _ in st.tries(matcher, at, candidates, accept, stats):
                pass
        searches = revisit_candidates(run.changes.take(block), block, matcher, anchor)


def _rewrite(run: _Run, sub: SubPass, st: BlockIndex, match: Pattern) -> bool:
    """Runs the transform (the constants the match reads read-only), removes the matched ops it left dead
    and checks the rewrite (:func:`~.contract.broken_contract`); False if the transform declined."""
    if run.journal is None:
        run.journal = Journal(run.ops_at_start)  # nothing was rewritten before
    st.observe()
    block = st.block
    matched = match.op_set
    outside_users = [user for var in match.output_vars() for user in var._child_ops if user not in matched]
    run.journal.keep_match(matched)
    n_inserted, n_removed = len(st.inserted), len(st.removed)
    returned = returned_names(block)
    frozen = read_only_constants(matched)  # the journal copies no tensor: writing into one must raise
    try:
        result = sub.transform_pattern(match)
    except Exception as exc:
        if frozen and isinstance(exc, ValueError) and "read-only" in str(exc):
            problem = f"transform_pattern wrote into a constant in place ({exc})"
            raise run.error(sub, problem, match, _NEW_CONSTANT) from exc
        raise run.error(sub, f"transform_pattern raised {type(exc).__name__}: {exc}", match) from exc
    finally:
        for value in frozen:
            value.flags.writeable = True
    created, removed = st.inserted[n_inserted:], st.removed[n_removed:]  # removed: by the transform
    if result is False:
        if created or removed:
            raise run.error(
                sub, "transform_pattern returned False (declined) after changing the program", match
            )
        return False
    dead = remove_dead(match)
    if not (created or removed or dead):
        raise run.error(
            sub,
            f"transform_pattern returned {result!r} without changing the program (no op inserted or removed)",
            match,
            f"{USE_THE_NEW_OPS} To leave a match as it is, return False.",
        )
    inputs_of_removed = [inputs for _, inputs in dead] + [flat_inputs(op) for op in removed]
    run.changes.record(sub.seed_types, [*created, *outside_users], inputs_of_removed)
    if run.validate and run.validate != "full":
        try:
            validate_rewrite(created, outside_users, removed)
        except Exception as exc:
            raise run.error(sub, f"the program is inconsistent after its rewrites: {exc}.") from exc
    breach = broken_contract(created, outside_users, block, returned, run.state, match.replacements())
    if breach is not None:
        raise run.error(sub, f"transform_pattern {breach[0]}", match, breach[1])
    for listener in rewrite_listeners:  # a trace is open (pattern_infra.trace)
        listener(run.prog, run.pass_name, sub.name, block, match.op_list(), created, st.removed[n_removed:])
    return True


rewrite_listeners: list[Callable[..., None]] = []
"""Called after each rewrite with (program, pass id, pattern name, block, matched ops, created ops,
removed ops): :func:`pattern_infra.trace` registers one while a trace is open."""

_NEW_CONSTANT = (
    "Build a new constant for the new value (mb.const(val=..., before_op=...)): a program constant may "
    "be read by other ops, and the undo journal does not copy tensors."
)
