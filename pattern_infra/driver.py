"""Apply compiled patterns to a program in time linear in its size, and lose nothing on failure.

How a group of sub-passes runs on a program (``run_subpasses``):

1. Every block, nested ones included, is listed once, and its ops are indexed by type once. New ops
   created by transforms are added to the index as they are inserted (the block's op list is observed
   for the duration of the pass), so later sub-passes see them without a rescan.
2. For each sub-pass, in order, and each block: the anchor is the pattern op whose type is rarest in the
   block, and only ops of that type are tried. After a match, the user's constraints and transform run;
   matched ops left without consumers are removed in one call; the ops the rewrite created, the ops whose
   operands changed and the producers of removed ops' operands are *touched*.
3. Nothing is rescanned from the start. When a sweep is over, only anchor candidates within the
   pattern's radius of a touched op are tried again (the anchor's eccentricity in the pattern graph,
   plus one hop for an op just outside a match), until a sweep changes nothing. A pass still rewriting
   after ``max_iterations`` such rounds re-creates its own pattern: :class:`FixpointError`.
4. The first time a transform is about to run, the program's structure is checkpointed (a shallow copy
   of every block, op and variable: no tensor is copied). If a constraint or transform raises, or the
   validation after a sub-pass finds the program inconsistent, the program is restored from it,
   identical to what it was before the pass, and :class:`PassExecutionError` names the pass, the
   pattern and (for a callback) the matched ops.
5. A block's builder context (``with block:``) is entered only when a rewrite needs it, and a
   function's block stays entered for the rest of the run; cyclic GC is paused during the run.
"""

from __future__ import annotations

import functools
import gc
import logging
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program, Var
from coremltools.converters.mil.mil.utils import CacheDoublyLinkedList
from coremltools.converters.mil.mil.var import InternalVar

from .compiler import CompiledPattern
from .errors import FixpointError, PassExecutionError, PatternInfraError
from .matcher import Matcher
from .pattern import Pattern

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

    def __post_init__(self) -> None:
        self.matcher = Matcher(self.compiled)

    @property
    def name(self) -> str:
        """The pattern's name."""
        return self.compiled.name


def iter_blocks(prog: Program) -> Iterator[Block]:
    """Every block of every function, outer blocks before the blocks nested in their ops."""
    for func in prog.functions.values():
        yield from _blocks_of(func)


def _blocks_of(block: Block) -> Iterator[Block]:
    yield block
    for op in list(block.operations):
        for inner in op.blocks:
            yield from _blocks_of(inner)


class _BlockState:
    """Index of one block's ops by type, kept current while the pass runs."""

    def __init__(self, block: Block) -> None:
        self.block = block
        ops = list(block.operations)
        self.position: dict[int, int] = {id(op): i for i, op in enumerate(ops)}
        self.by_type: dict[str, list[Operation]] = {}
        for op in ops:
            self.by_type.setdefault(op.op_type, []).append(op)
        self.counts = Counter({t: len(v) for t, v in self.by_type.items()})
        self.inserted: list[Operation] = []
        self.removed_inputs: list[Operation] = []
        self.removed = 0
        self._observed = False

    def observe(self) -> None:
        """Records ops inserted into and removed from the block, until ``release``."""
        if self._observed:
            return
        ops_list = self.block.operations
        if not isinstance(ops_list, CacheDoublyLinkedList):
            return
        original_insert = ops_list.insert_op_before
        original_remove = ops_list.remove
        state = self

        def insert_op_before(new_op: Operation, before_op: Operation | None = None) -> None:
            original_insert(new_op, before_op)
            state.inserted.append(new_op)
            state.by_type.setdefault(new_op.op_type, []).append(new_op)
            state.counts[new_op.op_type] += 1

        def remove(op: Operation) -> None:
            original_remove(op)
            state.removed += 1
            for var in _flat_inputs(op):
                if var.op is not None:
                    state.removed_inputs.append(var.op)
            state.counts[op.op_type] -= 1

        ops_list.insert_op_before = insert_op_before
        ops_list.remove = remove
        self._observed = True

    def release(self) -> None:
        """Stops observing the block."""
        if self._observed:
            ops_list = self.block.operations
            for attr in ("insert_op_before", "remove"):
                ops_list.__dict__.pop(attr, None)
            self._observed = False

    def anchor_candidates(self, matcher: Matcher) -> tuple[int, list[Operation]] | None:
        """The anchor for ``matcher`` in this block and the ops of its type(s), in program order.

        None when some pattern op has no op of its type(s) in the block: nothing can match (the cheap
        rejection, before any search).
        """
        for node in matcher.nodes:
            if not any(self.counts.get(t, 0) > 0 for t in node.op_types):
                return None
        anchor = matcher.choose_anchor(self.counts)
        types = matcher.nodes[anchor].op_types
        candidates = [op for t in sorted(types) for op in self.by_type.get(t, ())]
        return anchor, (self.order(candidates) if len(types) > 1 else candidates)

    def order(self, ops: list[Operation]) -> list[Operation]:
        """Sorts ``ops`` of this block into program order."""
        if all(id(op) in self.position for op in ops):
            return sorted(ops, key=lambda op: self.position[id(op)])
        index = {id(op): i for i, op in enumerate(self.block.operations)}
        return sorted(ops, key=lambda op: index.get(id(op), len(index)))


class _Checkpoint:
    """Shallow structural copy of a program: blocks, ops and variables, never tensors.

    What coremltools' Block, builder and ``set_inputs`` APIs change is kept: an op's attribute dict
    (with its ``_input_vars`` map copied), a variable's slots (with its consumer lists copied), a
    block's fields and op order. Other object kinds are copied generically (every attribute, containers
    one level deep).
    """

    def __init__(self, prog: Program) -> None:
        self.blocks: list[tuple[Block, list[Operation], dict[str, Any]]] = []
        self.ops: list[tuple[Operation, dict[str, Any]]] = []
        self.vars: list[tuple[Var, tuple[Any, ...]]] = []
        self.others: list[tuple[Any, dict[str, Any]]] = []
        seen: set[int] = set()
        for block in iter_blocks(prog):
            ops = list(block.operations)
            self.blocks.append((block, ops, _fields(block, skip=("operations",))))
            for var in list(block.inputs.values() if isinstance(block.inputs, dict) else block.inputs):
                self._keep_var(var, seen)
            for op in ops:
                state = dict(vars(op))
                state["_input_vars"] = dict(state["_input_vars"])
                self.ops.append((op, state))
                for var in op.outputs:
                    self._keep_var(var, seen)

    def _keep_var(self, var: Any, seen: set[int]) -> None:
        if id(var) in seen:
            return
        seen.add(id(var))
        if type(var) is Var:
            self.vars.append((var, _var_state(var)))
        else:
            self.others.append((var, _fields(var)))

    def restore(self) -> None:
        """Puts every block, op and variable back as it was."""
        for op, state in self.ops:
            fresh = dict(state)
            fresh["_input_vars"] = dict(state["_input_vars"])
            vars(op).clear()
            vars(op).update(fresh)
        for var, state in self.vars:
            _set_var_state(var, state)
        for obj, saved in self.others:
            _set_fields(obj, saved)
        for block, ops, saved in self.blocks:
            _set_fields(block, saved)
            block.operations = CacheDoublyLinkedList(ops)


_VAR_SLOTS: tuple[str, ...] = tuple(
    name for name in Var.__slots__ if name not in ("_child_ops", "consuming_blocks", "_nonreplaceable_vars_upstream")
)
_var_slots = operator.attrgetter(*_VAR_SLOTS)


def _var_state(var: Var) -> tuple[Any, ...]:
    return (
        _var_slots(var),
        list(var._child_ops),
        list(var.consuming_blocks),
        set(var._nonreplaceable_vars_upstream),
    )


def _set_var_state(var: Var, state: tuple[Any, ...]) -> None:
    values, child_ops, consuming_blocks, upstream = state
    for name, value in zip(_VAR_SLOTS, values):
        object.__setattr__(var, name, value)
    var._child_ops = list(child_ops)
    var.consuming_blocks = list(consuming_blocks)
    var._nonreplaceable_vars_upstream = set(upstream)


@functools.cache
def _slot_names(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.extend([slots] if isinstance(slots, str) else slots)
    return tuple(n for n in names if n != "__dict__")


_MISSING = object()
_CONTAINERS = (list, dict, set)


def _copy_value(value: Any) -> Any:
    return value.copy() if isinstance(value, _CONTAINERS) else value


def _fields(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every attribute of ``obj`` (dict and slots), containers copied one level deep."""
    state = getattr(obj, "__dict__", None)
    saved: dict[str, Any] = {}
    if state is not None:
        for key, value in state.items():
            saved[key] = value.copy() if isinstance(value, _CONTAINERS) else value
    for key in _slot_names(type(obj)):
        value = getattr(obj, key, _MISSING)
        if value is not _MISSING:
            saved[key] = value.copy() if isinstance(value, _CONTAINERS) else value
    for key in skip:
        saved.pop(key, None)
    return saved


def _set_fields(obj: Any, saved: dict[str, Any]) -> None:
    if hasattr(obj, "__dict__"):
        for key in [k for k in vars(obj) if k not in saved and k != "operations"]:
            del vars(obj)[key]
    for key, value in saved.items():
        object.__setattr__(obj, key, _copy_value(value))


class _Run:
    """One application of a group of sub-passes to a program."""

    def __init__(self, prog: Program, pass_name: str, validate: bool | str) -> None:
        self.prog = prog
        self.pass_name = pass_name
        self.validate = validate
        self.checkpoint: _Checkpoint | None = None
        self.states: dict[int, _BlockState] = {}
        self.touched: list[Operation] = []
        self.open_block: Block | None = None

    def close(self) -> None:
        """Leaves the function block kept open by :class:`_LazyBlockContext`, if any."""
        if self.open_block is not None:
            block, self.open_block = self.open_block, None
            block.__exit__(None, None, None)

    def state(self, block: Block) -> _BlockState:
        st = self.states.get(id(block))
        if st is None:
            st = _BlockState(block)
            self.states[id(block)] = st
        return st

    def fail(self, sub: SubPass, what: str, match: Pattern, exc: BaseException) -> PassExecutionError:
        restored = self.restore()
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

    def restore(self) -> bool:
        self.release()
        if self.checkpoint is None:
            return False
        self.checkpoint.restore()
        return True

    def release(self) -> None:
        for st in self.states.values():
            st.release()


def run_subpasses(
    prog: Program,
    subpasses: list[SubPass],
    pass_name: str,
    *,
    validate: bool | str = True,
) -> PassStats:
    """Applies each sub-pass, in order, to every block of ``prog``.

    Args:
        prog: The program, changed in place.
        subpasses: The sub-passes, already in run order.
        pass_name: Pass id, for messages.
        validate: After each sub-pass that rewrote: ``True`` checks the invariants of coremltools'
            ``Block.validate`` on the ops it created or rewired (linear in what changed); ``"full"``
            validates the whole program; ``False`` skips it. coremltools' pipeline validates the whole
            program after every pass anyway.

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
    # restored as it was.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        blocks = list(iter_blocks(prog))
        for sub in subpasses:
            stats = PassStats(runs=1)
            start = time.perf_counter()
            bind_before = sub.matcher.bind_attempts
            for block in blocks:
                if block.outer_op is not None and block.outer_op.enclosing_block is None:
                    continue  # removed with its op by an earlier rewrite
                with _LazyBlockContext(run, block) as context:
                    _sweep(run, sub, run.state(block), stats, context)
            stats.bind_attempts = sub.matcher.bind_attempts - bind_before
            stats.seconds = time.perf_counter() - start
            sub.stats.add(stats)
            total.add(stats)
            if stats.rewrites and validate:
                try:
                    if validate == "full":
                        prog.validate()
                    else:
                        _validate_touched(run.touched)
                except Exception as exc:
                    run.restore()
                    raise PassExecutionError(
                        f"Pass {pass_name!r}, pattern {sub.name!r}: the program is inconsistent after "
                        f"its rewrites: {exc}. The program was restored to its state before the pass."
                    ) from exc
            run.touched.clear()
    except PatternInfraError:
        raise
    except Exception as exc:  # an error of coremltools' own while applying the rewrite
        run.restore()
        raise PassExecutionError(
            f"Pass {pass_name!r} failed while rewriting: {type(exc).__name__}: {exc}. The program "
            f"was restored to its state before the pass."
        ) from exc
    finally:
        run.close()
        run.release()
        if gc_was_enabled:
            gc.enable()
    return total


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
            self.block.__exit__(*exc)


def _sweep(run: _Run, sub: SubPass, st: _BlockState, stats: PassStats, context: _LazyBlockContext) -> None:
    """One sub-pass over one block, then over what its rewrites touched, until nothing changes.

    ``context`` enters the block's builder context before the first transform only, so sub-passes that
    rewrite nothing never pay for it (see :class:`_LazyBlockContext`).
    """
    matcher = sub.matcher
    found = st.anchor_candidates(matcher)
    if found is None:
        return
    anchor, candidates = found
    anchor_types = matcher.nodes[anchor].op_types
    radius = matcher.radius[anchor]
    block = st.block
    iteration = 0
    last: Pattern | None = None
    while candidates:
        iteration += 1
        if iteration > sub.max_iterations:
            run.restore()
            ops = ", ".join(op.name for op in last.op_list()) if last else "?"
            raise FixpointError(
                f"Pass {run.pass_name!r}, pattern {sub.name!r}: still rewriting after "
                f"{sub.max_iterations} rounds (last match: [{ops}]). Its transform re-creates the "
                f"pattern it replaces; make the replacement differ from the pattern, or raise "
                f"max_iterations. The program was restored to its state before the pass."
            )
        stats.iterations += 1
        touched: list[Operation] = []
        for op in candidates:
            if op.enclosing_block is not block:
                continue
            stats.attempts += 1
            match = matcher.match_at(op, block, anchor, order=st.order)
            if match is None:
                continue
            stats.matches += 1
            if not _accepts(run, sub, match):
                stats.rejected += 1
                continue
            context.enter()
            changed = _rewrite(run, sub, st, match)
            if changed is None:
                stats.declined += 1
                continue
            stats.rewrites += 1
            last = match
            touched.extend(changed)
        candidates = _near(touched, block, anchor_types, radius) if touched else []


def _flat_inputs(op: Operation) -> list[Var]:
    """The variables ``op`` reads, one entry per use (``get_flattened_inputs`` without its dict copy)."""
    flat: list[Var] = []
    for value in op._input_vars.values():
        if isinstance(value, (list, tuple)):
            flat.extend(value)
        elif value is not None and not isinstance(value, InternalVar):
            flat.append(value)
    return flat


def _validate_touched(ops: list[Operation]) -> None:
    """Block.validate's invariants, on the ops a sub-pass created or rewired and their neighbours.

    Every use of a variable by an op is recorded once in the variable's consumers and the other way
    round; every op is in its block; block outputs know the blocks that return them.

    Raises:
        ValueError: An invariant does not hold (the caller restores the program).
    """
    seen: set[int] = set()
    for op in ops:
        if op.enclosing_block is None:
            continue  # removed by a later rewrite of the same sub-pass
        for var in _flat_inputs(op) + list(op.outputs):
            for user in var.child_ops:
                if id(user) in seen:
                    continue
                seen.add(id(user))
                _check_op(user)
        if id(op) not in seen:
            seen.add(id(op))
            _check_op(op)


def _check_op(op: Operation) -> None:
    block = op.enclosing_block
    if block is None:
        raise ValueError(f"op {op.name} is used but no longer in a block after the rewrite")
    inputs = _flat_inputs(op)
    uses = Counter(id(v) for v in inputs)
    for var in inputs:
        if var.child_ops.count(op) != uses[id(var)]:
            raise ValueError(
                f"after the rewrite, {var.name} lists op {op.name} {var.child_ops.count(op)} times among its "
                f"users, but the op reads it {uses[id(var)]} times"
            )
    for var in op.outputs:
        for consumer_block in var.consuming_blocks:
            if var not in consumer_block.outputs:
                raise ValueError(f"{var.name} claims to be an output of {consumer_block.name}")


def _accepts(run: _Run, sub: SubPass, match: Pattern) -> bool:
    if sub.var_constraints is None:
        return True
    try:
        return bool(sub.var_constraints(match))
    except Exception as exc:
        raise run.fail(sub, "var_constraints", match, exc) from exc


def _rewrite(run: _Run, sub: SubPass, st: _BlockState, match: Pattern) -> list[Operation] | None:
    """Runs the transform; returns the touched ops, or None if it declined.

    A transform declines by returning False before changing anything; one that returns anything else
    but neither inserted nor removed an op (the framework's removal of dead matched ops included) left
    the match as it was, and is counted as declined too, so it is not retried until a cap.
    """
    if run.checkpoint is None:
        run.checkpoint = _Checkpoint(run.prog)
    st.observe()
    block = st.block
    matched = _ids(match)
    outside_users = [user for var in match.output_vars() for user in var.child_ops if id(user) not in matched]
    n_inserted, n_removed = len(st.inserted), len(st.removed_inputs)
    n_removed_ops = st.removed
    before = len(block.operations)
    try:
        result = sub.transform_pattern(match)
    except Exception as exc:
        raise run.fail(sub, "transform_pattern", match, exc) from exc

    def changed_structure() -> bool:
        return (
            len(st.inserted) != n_inserted
            or st.removed != n_removed_ops
            or len(block.operations) != before
        )

    if result is False:
        if changed_structure():
            raise run.fail(
                sub,
                "transform_pattern",
                match,
                RuntimeError("it returned False (declined) after changing the program"),
            )
        return None
    remove_dead_ops(match)
    if not changed_structure():
        return None  # nothing inserted or removed: the transform left the match as it was
    touched = st.inserted[n_inserted:] + st.removed_inputs[n_removed:]
    touched.extend(outside_users)  # root producers are among the removed ops' input producers
    touched = [op for op in touched if op.enclosing_block is block]
    run.touched.extend(touched)
    return touched


def remove_dead_ops(match: Pattern) -> list[Operation]:
    """Removes, in one call, the matched ops still in the block whose outputs nothing uses.

    This is what lets a transform only build the replacement and redirect the outputs: the framework
    deletes what the replacement made dead.

    Returns:
        The removed ops.
    """
    block = match.block
    dead_ids: set[int] = set()
    dead: list[Operation] = []
    for op in reversed(match.op_list()):
        if op.enclosing_block is block and all(
            not v.consuming_blocks and all(id(user) in dead_ids for user in v.child_ops)
            for v in op.outputs
        ):
            dead_ids.add(id(op))
            dead.append(op)
    if dead:
        block.remove_ops(dead)
    return dead


def _ids(match: Pattern) -> set[int]:
    return {id(op) for op in match.op_set}


def _near(
    touched: list[Operation], block: Block, anchor_types: frozenset[str], radius: int
) -> list[Operation]:
    """Anchor candidates within ``radius`` producer/consumer steps of a touched op."""
    seen: dict[int, Operation] = {}
    frontier = list(dict.fromkeys(touched))
    for op in frontier:
        seen[id(op)] = op
    for _ in range(radius):
        nxt: list[Operation] = []
        for op in frontier:
            neighbours: list[Operation] = []
            for var in _flat_inputs(op):
                if var.op is not None and var.op.op_type == "const":
                    continue  # constants may feed thousands of ops and join no match
                if var.op is not None:
                    neighbours.append(var.op)
                neighbours.extend(var.child_ops)  # siblings: ops joined through a shared input
            for var in op.outputs:
                neighbours.extend(var.child_ops)
            for other in neighbours:
                if id(other) not in seen and other.enclosing_block is block:
                    seen[id(other)] = other
                    nxt.append(other)
        frontier = nxt
        if not frontier:
            break
    return [op for op in seen.values() if op.op_type in anchor_types and op.enclosing_block is block]


def find_in_program(
    prog: Program,
    matcher: Matcher,
    var_constraints: Constraints | None = None,
) -> Iterator[Pattern]:
    """Yields every match of ``matcher``'s pattern in ``prog``, lazily, without changing it.

    Each anchor op yields at most one match; matches may overlap. Blocks are visited outer first.
    """
    for block in iter_blocks(prog):
        st = _BlockState(block)
        found = st.anchor_candidates(matcher)
        if found is None:
            continue
        anchor, candidates = found
        seen: set[frozenset[int]] = set()
        for op in candidates:
            if op.enclosing_block is not block:
                continue
            match = matcher.match_at(op, block, anchor, order=st.order)
            if match is None:
                continue
            key = frozenset(id(o) for o in match.op_set)
            if key in seen:
                continue
            if var_constraints is not None and not var_constraints(match):
                continue
            seen.add(key)
            yield match
