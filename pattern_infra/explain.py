"""Why does my pattern not match? The nearest partial matches, and where each one stopped.

``explain`` tries every pattern op as the anchor at every program op of its type (a diagnostic, so it
does not take the driver's shortcuts), records for each attempt how many pattern ops were bound and the
first reason the search gave up, and reports the attempts that got furthest. Every complete structural
match goes on to ``var_constraints`` ("constraint returned False", with the reason the constraint gave)
and, if a transform is given, to the transform on a copy of the program ("transform declined"): the
program passed in is never changed. A match turned down lets the search go on, as in a pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coremltools.converters.mil.mil import Program

from .rewriting.blocks import BlockIndex, iter_blocks
from .matching.matcher import Failure, Matcher
from .language.pattern import Pattern
from .pipeline.container import PassContainer
from .find import (
    ALREADY_FOUND,
    COLLECTED,
    INSIDE_LONGER,
    PatternSource,
    anchored_blocks,
    distinct_matches,
    has_fallback,
    resolve_patterns,
)

__all__ = ["Explanation", "Explanations", "explain"]


@dataclass
class Explanation:
    """What ``explain`` found."""

    pattern: str
    """The pattern's name."""
    pattern_size: int
    """Number of ops in the pattern."""
    matches: list[Pattern] = field(default_factory=list)
    """Complete matches that passed the constraints (and the transform, if one was given)."""
    near_misses: list[Failure] = field(default_factory=list)
    """The partial matches that got furthest, best first."""

    def __str__(self) -> str:
        lines = [f"pattern {self.pattern!r} ({self.pattern_size} ops): {len(self.matches)} full match(es)"]
        for m in self.matches:
            lines.append("  match: " + ", ".join(f"{k}={op.name}" for k, op in _flat(m)))
        for miss in self.near_misses:
            bound = ", ".join(f"{k}={v}" for k, v in miss.ops.items()) or "nothing"
            lines.append(
                f"  near miss: {miss.bound}/{self.pattern_size} ops bound ({bound}); "
                f"failed at {miss.node!r}: {miss.reason}"
            )
        if not self.matches and not self.near_misses:
            lines.append("  no program op has the type of any pattern op")
        return "\n".join(lines)


class Explanations(list):
    """One :class:`Explanation` per pattern, for ``explain`` given several patterns or a registered pass."""

    @property
    def matches(self) -> list[Pattern]:
        """The full matches of every pattern."""
        return [m for explanation in self for m in explanation.matches]

    def __str__(self) -> str:
        return "\n".join(str(explanation) for explanation in self)


def _flat(match: Pattern) -> list[tuple[str, Any]]:
    out = []
    for name, op in match.ops.items():
        for one in op if isinstance(op, list) else [op]:
            out.append((name, one))
    return out


def explain(
    ops_arrangement: PatternSource,
    prog: Program,
    var_constraints: Callable[[Pattern], Any] | None = None,
    transform_pattern: Callable[[Pattern], Any] | None = None,
    *,
    top: int = 3,
    **pattern_options: Any,
) -> Explanation:
    """Reports full matches and the nearest partial matches of a pattern in ``prog``.

    Args:
        ops_arrangement: The pattern program; or a list of them; or a registered pass (its
            ``PassContainer`` or pass id), whose patterns are explained with the options and the
            ``var_constraints`` of their registration.
        prog: The program to search (never changed).
        var_constraints: Applied to full matches; a False is reported as "constraint returned False".
            For a registered pass: instead of its own.
        transform_pattern: If given, run on each accepted match of a *copy* of ``prog``; a False return
            is reported as "transform declined".
        top: How many near misses to report.
        **pattern_options: As for ``register_generic_pass`` (``commutative``, ``alternatives``, ...).

    Returns:
        An :class:`Explanation` (for several patterns or a pass, :class:`Explanations`, one per
        pattern); ``str()`` of it is a readable report.
    """
    targets = resolve_patterns(ops_arrangement, var_constraints, pattern_options)
    if isinstance(ops_arrangement, (list, tuple, str, PassContainer)):
        return Explanations(explain(c, prog, vc, transform_pattern, top=top) for c, vc in targets)
    compiled, var_constraints = targets[0]
    matcher = Matcher(compiled)
    result = Explanation(compiled.name, len(matcher.nodes))
    misses: dict[tuple[int, str, str], Failure] = {}
    refused: set[str] = set()

    def refusal(found: Pattern, reason: str) -> None:
        refused.add(reason)
        failure = Failure(len(matcher.nodes), matcher.nodes[-1].name, reason, _names(found))
        misses.setdefault((failure.bound, failure.reason, str(sorted(failure.ops.items()))), failure)

    for block in iter_blocks(prog):
        st = BlockIndex(block)
        offered = distinct_matches(
            var_constraints, result.matches.append, refusal, longest=has_fallback(compiled)
        )
        for node in matcher.nodes:
            if node.fanout:
                continue
            for t in sorted(node.op_types):
                for found in st.tries(matcher, node.index, st.by_type.get(t, ()), offered, trace=True):
                    if (
                        isinstance(found, Failure)
                        and found.reason not in _ANSWERS
                        and found.reason not in refused
                    ):
                        key = (0, found.node, found.reason)
                        if key not in misses or misses[key].bound < found.bound:
                            misses[key] = found
    if transform_pattern is not None and result.matches:
        result.matches = _try_transforms(prog, result, compiled.name, matcher, transform_pattern, misses)
    ranked = sorted(misses.values(), key=lambda f: (-f.bound, f.node, f.reason))
    result.near_misses = ranked[:top]
    return result


_ANSWERS = (ALREADY_FOUND, INSIDE_LONGER, COLLECTED)
"""What :func:`~pattern_infra.find.distinct_matches` answers for a match it does not refuse: not
search failures to report."""


def _names(match: Pattern) -> dict[str, str]:
    return {k: op.name for k, op in _flat(match)}


def _try_transforms(
    prog: Program,
    result: Explanation,
    name: str,
    matcher: Matcher,
    transform_pattern: Callable[[Pattern], Any],
    misses: dict[tuple[int, str, str], Failure],
) -> list[Pattern]:
    """Runs the transform on a copy; keeps the matches it did not decline."""
    from .clone import clone_program

    wanted = [_names(m) for m in result.matches]
    clone = clone_program(prog)
    kept: list[Pattern] = []
    for st, anchor, candidates in anchored_blocks(clone, matcher):
        block = st.block

        def rewrite(match: Pattern) -> Any:
            names = _names(match)
            if names not in wanted:
                return "not a match of the original program"
            with block:
                declined = transform_pattern(match) is False
            if declined:
                failure = Failure(len(matcher.nodes), match.final_op.name, "transform declined", names)
                misses.setdefault((failure.bound, failure.node, failure.reason + str(names)), failure)
                return "transform declined"
            kept.append(result.matches[wanted.index(names)])
            return True

        for _ in st.tries(matcher, anchor, candidates, rewrite):
            pass
    return kept
