"""Finding matches without the driver's bookkeeping (``find_matches``, ``explain``'s), and the design
document's ``fuse_one_block`` / ``fuse_all_blocks``, which run the driver (journal and contract included).

Owns: :func:`distinct_matches` (an ``accept`` that collects each distinct accepted match and takes none,
so a search enumerates them all), :func:`find_in_program`, :func:`resolve_patterns` (what a pattern
source names: programs, a registered pass, its id) and the user-facing :func:`find_matches`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from coremltools.converters.mil.mil import Block, Operation, Program
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ..language.compiler import CompiledPattern, compile_pattern, require_program
from ..language.errors import PassRegistrationError
from ..language.pattern import Pattern
from ..matching.matcher import Matcher
from ..passes.container import PassContainer
from ..passes.registry import generic_passes
from ..rewriting.blocks import BlockIndex, walk_blocks
from ..rewriting.driver import run_subpasses
from ..rewriting.subpass import Constraints, PassStats, SubPass, constraint_verdict

__all__ = [
    "PatternSource",
    "anchored_blocks",
    "has_fallback",
    "distinct_matches",
    "find_in_program",
    "find_matches",
    "fuse_all_blocks",
    "fuse_one_block",
    "resolve_patterns",
]

ALREADY_FOUND, INSIDE_LONGER, COLLECTED = "already found", "inside a longer spelling found", "collected"
"""What :func:`distinct_matches` answers for a match it does not refuse (not search failures)."""


def has_fallback(compiled: CompiledPattern) -> bool:
    """Whether a choice of ``compiled``, at any depth, was declared with ``fallback=True``."""
    return any(guard.fallback for variant in compiled.variants for guard in variant.guards)


def anchored_blocks(prog: Program, matcher: Matcher) -> Iterator[tuple[BlockIndex, int, list[Operation]]]:
    """Each block of ``prog`` that may hold a match, freshly indexed, with its anchor and candidates
    (:meth:`BlockIndex.anchor_candidates`), outer blocks first: for searches outside a pass."""
    for block, _ in walk_blocks(prog):
        index = BlockIndex(block)
        found = index.anchor_candidates(matcher)
        if found is not None:
            yield index, *found


def distinct_matches(
    var_constraints: Constraints | None,
    on_match: Callable[[Pattern], Any],
    on_refusal: Callable[[Pattern, str], Any] | None = None,
    *,
    longest: bool = False,
) -> Callable[[Pattern], str]:
    """An ``accept`` that takes no match, so a search enumerates every one, and hands each distinct set
    of program ops the constraints accept to ``on_match`` once (with its first accepted assignment).

    A set refused under one assignment (operand order) is offered again under the next; each refusal goes
    to ``on_refusal`` with its reason. Shared by :func:`find_in_program` and ``explain``.

    ``longest`` (a pattern with a ``fallback`` choice, :func:`has_fallback`):
    a set inside one already accepted is skipped, so the shorter spelling is reported only where the
    longer one is refused, as the pass would rewrite (the search offers the longer spelling first).
    """
    seen: set[frozenset[int]] = set()
    containing: dict[int, list[frozenset[int]]] = {}
    """Program op (by id) to the accepted sets holding it, for ``longest``."""

    def collect(match: Pattern) -> str:
        key = frozenset(id(o) for o in match.op_set)
        if key in seen:
            return ALREADY_FOUND
        if longest and any(key < other for other in containing.get(next(iter(key)), ())):
            return INSIDE_LONGER
        if var_constraints is not None:
            reason = constraint_verdict(var_constraints(match))
            if reason is not None:
                if on_refusal is not None:
                    on_refusal(match, reason)
                return reason
        seen.add(key)
        if longest:
            for op_id in key:
                containing.setdefault(op_id, []).append(key)
        on_match(match)
        return COLLECTED  # not taken: the search goes on to the next match

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
    longest = has_fallback(matcher.compiled)
    for st, anchor, candidates in anchored_blocks(prog, matcher):
        here: list[Pattern] = []
        collect = distinct_matches(var_constraints, here.append, longest=longest)
        for _ in st.tries(matcher, anchor, candidates, collect):
            yield from here
            here.clear()


def _sub_pass(ops_arrangement: Program, var_constraints: Any, transform_pattern: Any) -> SubPass:
    return SubPass(compile_pattern(ops_arrangement), var_constraints, transform_pattern)


def fuse_all_blocks(
    ops_arrangement: Program,
    var_constraints: Callable[[Pattern], Any] | None,
    transform_pattern: Callable[[Pattern], Any],
    prog: Program,
) -> PassStats:
    """Replaces every instance of the pattern in every block of ``prog`` (design-document API).

    Returns:
        Counters of the run.
    """
    sub = _sub_pass(ops_arrangement, var_constraints, transform_pattern)
    return run_subpasses(prog, [sub], f"fuse_all_blocks({sub.name})")


def fuse_one_block(
    block: Block,
    ops_arrangement: Program,
    var_constraints: Callable[[Pattern], Any] | None,
    transform_pattern: Callable[[Pattern], Any],
) -> bool:
    """Replaces the first instance of the pattern in ``block`` (design-document API), as a pass's run
    does (:func:`run_subpasses`: the match's dead ops removed, the rewrite's contract checked, the block
    restored if the transform raises): every later match is declined.

    Returns:
        Whether a match was rewritten.

    Raises:
        PassExecutionError: A callback raised or the rewrite broke its contract; the block is as it was.
    """
    done: list[Pattern] = []

    def here(match: Pattern) -> Any:
        return match.block is block and (var_constraints is None or var_constraints(match))

    def first(match: Pattern) -> Any:
        if done:
            return False
        result = transform_pattern(match)
        if result is not False:
            done.append(match)
        return result

    sub = _sub_pass(ops_arrangement, here, first)
    return run_subpasses(_BlockProgram(block), [sub], f"fuse_one_block({sub.name})").rewrites > 0


class _BlockProgram:
    """Lets find_in_program walk a single block (and its nested blocks)."""

    def __init__(self, block: Block) -> None:
        self.functions = {"main": block}


PatternSource = Any
"""What ``find_matches`` and ``explain`` search for: a pattern program, a list of them, a registered
pass (a :class:`PassContainer` or its id ``"namespace::name"``) or a compiled pattern."""


def resolve_patterns(
    ops_arrangement: PatternSource,
    var_constraints: Callable[[Pattern], Any] | None,
    pattern_options: Mapping[str, Any],
) -> list[tuple[CompiledPattern, Callable[[Pattern], Any] | None]]:
    """The compiled patterns to search for, each with the constraints to apply.

    A registered pass gives its sub-passes' patterns (of a sub-pass of several programs, each program's),
    compiled with the options of their registration, each with its own ``var_constraints`` unless
    ``var_constraints`` is given.

    Raises:
        PassRegistrationError: A pass id that is not registered, a pass without pattern sub-passes, or
            pattern options given with a registered pass (its options are those of the registration).
        PatternDefinitionError: A pattern program breaks a rule.
    """
    if isinstance(ops_arrangement, str):
        found = PASS_REGISTRY.passes.get(ops_arrangement)
        if not isinstance(found, PassContainer):
            near = difflib.get_close_matches(ops_arrangement, list(generic_passes()), n=3)
            hint = f" Did you mean {', '.join(near)}?" if near else ""
            raise PassRegistrationError(
                f"{ops_arrangement!r} is not a registered generic pass.{hint} Give a pattern program, a "
                f"list of them, or the PassContainer register_generic_pass returned."
            )
        ops_arrangement = found
    if isinstance(ops_arrangement, (PassContainer, SubPass)):
        if pattern_options:
            raise PassRegistrationError(
                f"{ops_arrangement!r}: pattern options {sorted(pattern_options)} cannot be given with a "
                f"registered pass, whose patterns keep the options they were registered with; drop them, "
                f"or pass the pattern program instead."
            )
        subs = ops_arrangement.passes if isinstance(ops_arrangement, PassContainer) else [ops_arrangement]
        if not subs:
            raise PassRegistrationError(
                f"{ops_arrangement!r} has no pattern sub-pass (only plain callables), so there is no "
                f"pattern to search for."
            )
        return [  # a pattern of several programs: each program's, as written
            (part, sub.var_constraints if var_constraints is None else var_constraints)
            for sub in subs
            for part in sub.compiled.parts or [sub.compiled]
        ]
    if isinstance(ops_arrangement, CompiledPattern):
        return [(ops_arrangement, var_constraints)]
    if isinstance(ops_arrangement, (list, tuple)):
        if not ops_arrangement:
            raise PassRegistrationError("An empty list of patterns: give at least one pattern program.")
        return [
            pair
            for item in ops_arrangement
            for pair in resolve_patterns(item, var_constraints, pattern_options)
        ]
    require_program(ops_arrangement, where="find_matches/explain")
    return [(compile_pattern(ops_arrangement, **pattern_options), var_constraints)]


def find_matches(
    ops_arrangement: PatternSource,
    prog: Program,
    var_constraints: Callable[[Pattern], Any] | None = None,
    **pattern_options: Any,
) -> Iterator[Pattern]:
    """Yields the matches of a pattern in ``prog`` lazily, never changing the program.

    Args:
        ops_arrangement: The pattern program; or a list of them; or a registered pass (its
            ``PassContainer`` or pass id), whose patterns are searched with the options and the
            ``var_constraints`` of their registration.
        prog: The program to search.
        var_constraints: Only matches it accepts are yielded (for a registered pass: instead of its own).
        **pattern_options: As for :func:`register_generic_pass` (``commutative``, ``alternatives``,
            ``constants``, ``const_rules``, ``fanout``, ``equivalences``); not with a registered pass.

    Yields:
        One :class:`Pattern` per distinct set of matched ops, outer blocks first, in program order; with
        several patterns, the matches of each pattern in turn.
    """
    for compiled, constraints in resolve_patterns(ops_arrangement, var_constraints, pattern_options):
        yield from find_in_program(prog, Matcher(compiled), constraints)
