"""Why does my pattern not match? The nearest partial matches, and where each one stopped.

``explain`` tries every pattern op as the anchor at every program op of its type (a diagnostic, so it
does not take the driver's shortcuts), records for each attempt how many pattern ops were bound and the
first reason the search gave up, and reports the attempts that got furthest. Every complete structural
match goes on to ``var_constraints`` ("constraint returned False", with the reason the constraint gave)
and, if a transform is given, to the transform on a copy of the program ("transform declined"): the
program passed in is never changed. A match turned down lets the search go on, as in a pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from coremltools.converters.mil.mil import Program

from ..authoring.find import (
    ALREADY_FOUND,
    COLLECTED,
    INSIDE_LONGER,
    PatternSource,
    anchored_blocks,
    distinct_matches,
    has_fallback,
    resolve_patterns,
)
from ..language.pattern import Pattern
from ..matching.matcher import Failure, Matcher
from ..passes.container import PassContainer
from ..rewriting.blocks import BlockIndex, walk_blocks

__all__ = ["Explanation", "Explanations", "explain"]


@dataclass
class Explanation:
    """What ``explain`` found."""

    pattern: str
    """The pattern's name."""
    pattern_size: int
    """Number of ops of the pattern's longest spelling."""
    matches: list[Pattern] = field(default_factory=list)
    """Complete matches that passed the constraints (and the transform, if one was given)."""
    near_misses: list[Failure] = field(default_factory=list)
    """The partial matches that got furthest, best first; none at a program op a full match holds."""
    spellings: list[tuple[str, int]] = field(default_factory=list)
    """Per near miss, the spelling tried (its name, or ``""`` for a pattern of one spelling) and its
    number of ops."""

    def __str__(self) -> str:
        lines = [f"pattern {self.pattern!r}: {len(self.matches)} full match(es)"]
        for m in self.matches:
            lines.append("  match: " + ", ".join(f"{k}={op.name}" for k, op in _flat(m)))
        for i, miss in enumerate(self.near_misses):
            name, size = self.spellings[i] if i < len(self.spellings) else ("", self.pattern_size)
            of = f" of spelling {name}" if name else ""
            bound = ", ".join(f"{k}={v}" for k, v in miss.ops.items()) or "none"
            lines.append(
                f"  near miss: {miss.bound}/{size} ops{of} matched ({bound}); "
                f"stopped at {miss.node!r}: {miss.reason}"
            )
        if not self.matches and not self.near_misses:
            lines.append("  no program op has the type of any pattern op")
        return "\n".join(lines)


class Explanations(list[Explanation]):
    """One :class:`Explanation` per pattern, for ``explain`` given several patterns or a registered pass."""

    @property
    def matches(self) -> list[Pattern]:
        """The full matches of every pattern."""
        return [m for explanation in self for m in explanation.matches]

    def __str__(self) -> str:
        return "\n".join(str(explanation) for explanation in self)


def _flat(match: Pattern) -> list[tuple[str, Any]]:
    """Pattern op name and program op, each program op once (under its first name: an op computing a
    choice's variable is bound under its own name and the choice's)."""
    out, seen = [], set()
    for name, op in match.ops.items():
        for one in op if isinstance(op, list) else [op]:
            if id(one) not in seen:
                seen.add(id(one))
                out.append((name, one))
    return out


def _spelling_of(matcher: Matcher, failure: Failure) -> tuple[str, int]:
    """The spelling a failure was in: the first whose ops include every op bound and the op it stopped
    at; its name (its number and the alternative it takes at each choice, ``""`` for a pattern of one
    spelling) and its number of ops."""
    wanted = {*failure.ops, failure.node}
    names = [{matcher.ops[i].name for i in index} for index in matcher.index]
    v = next((v for v, ops in enumerate(names) if wanted <= ops), 0)
    if len(matcher.variants) == 1:
        return "", len(names[v])
    taken: dict[str, str] = {}
    for choice, words in matcher.variants[v].within.values():
        taken.setdefault(choice, words)
    label = "; ".join(f"{choice} = {words}" for choice, words in taken.items())
    return f"{v + 1} of {len(names)} ({label})" if label else f"{v + 1} of {len(names)}", len(names[v])


def _readable(failure: Failure) -> Failure:
    """The failure with each program op named once and its reason in a user's words."""
    ops: dict[str, str] = {}
    for k, v in failure.ops.items():
        if v not in ops.values():
            ops[k] = v
    reason = failure.reason
    found = re.match(r"an earlier alternative of '(\w+)' matches further down(.*)", reason)
    if found:
        reason = (
            f"choice {found[1]!r} takes its first alternative that matches, and an earlier one "
            f"matches here{found[2]}"
        )
    reason = re.sub(r" \(alternative .* of '\w+'\)$", "", reason)  # the spelling names it
    reason = re.sub(
        r"^no unmatched consumer of (\S+) has type (.+)$", r"no other consumer of \1 is a \2 op", reason
    )
    return Failure(len(ops), failure.node, reason, ops)


def explain(
    ops_arrangement: PatternSource,
    prog: Program,
    var_constraints: Callable[[Pattern], Any] | None = None,
    transform_pattern: Callable[[Pattern], Any] | None = None,
    *,
    top: int = 3,
    **pattern_options: Any,
) -> Explanation | Explanations:
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
        # one compiled pattern each: an Explanation
        return Explanations(
            cast(Explanation, explain(c, prog, vc, transform_pattern, top=top)) for c, vc in targets
        )
    compiled, var_constraints = targets[0]
    matcher = Matcher(compiled)
    result = Explanation(compiled.name, max(map(len, matcher.index)))
    misses: dict[tuple[int, str, str], Failure] = {}
    refused: set[str] = set()

    def refusal(found: Pattern, reason: str) -> None:
        refused.add(reason)
        failure = Failure(len(matcher.nodes), matcher.nodes[-1].name, reason, _names(found))
        misses.setdefault((failure.bound, failure.reason, str(sorted(failure.ops.items()))), failure)

    for block, _ in walk_blocks(prog):
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
                        and not found.reason.startswith(_ANSWERS)
                        and found.reason not in refused
                    ):
                        key = (0, found.node, found.reason)
                        if key not in misses or misses[key].bound < found.bound:
                            misses[key] = found
    if transform_pattern is not None and result.matches:
        result.matches = _try_transforms(prog, result, compiled.name, matcher, transform_pattern, misses)
    taken = {op.name for m in result.matches for _, op in _flat(m)}
    readable = [f for f in map(_readable, misses.values()) if not taken & set(f.ops.values())]
    unique = {(f.bound, f.node, f.reason, str(f.ops)): f for f in readable}
    ranked = sorted(unique.values(), key=lambda f: (-f.bound, f.node, f.reason))
    result.near_misses = ranked[:top]
    result.spellings = [_spelling_of(matcher, f) for f in result.near_misses]
    return result


_ANSWERS = (ALREADY_FOUND, INSIDE_LONGER, COLLECTED)
"""What :func:`~pattern_infra.authoring.find.distinct_matches` answers for a match it does not refuse: not
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
    from ..authoring.clone import clone_program

    wanted = [_names(m) for m in result.matches]
    clone = clone_program(prog)
    kept: list[Pattern] = []
    for st, anchor, candidates in anchored_blocks(clone, matcher):
        block = st.block

        def rewrite(match: Pattern, block: Any = block) -> Any:
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
