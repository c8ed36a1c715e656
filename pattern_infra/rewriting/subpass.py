"""What a generic pass is made of: :class:`SubPass` (a compiled pattern with its callbacks), its counters
(:class:`PassStats`) and what a constraint's answer means (:func:`constraint_verdict`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..language.compiler import CompiledPattern
from ..language.errors import PassExecutionError
from ..language.pattern import Pattern
from ..matching.matcher import Matcher
from ..matching.plan import PassStats

__all__ = ["DEFAULT_MAX_ITERATIONS", "PassStats", "SubPass", "constraint_verdict"]

DEFAULT_MAX_ITERATIONS = 32
"""Rounds of re-visiting touched ops before a pass is declared to re-create its own pattern."""

Constraints = Callable[[Pattern], Any]


@dataclass
class SubPass:
    """One pattern with its callbacks, as registered."""

    compiled: CompiledPattern
    """The pattern."""
    var_constraints: Constraints | None
    """Returns truthy to accept a match (None accepts all)."""
    transform_pattern: Callable[[Pattern], Any]
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
        self.seed_types = None if self.compiled.has_fanout else self.matcher.op_types

    @property
    def name(self) -> str:
        """The pattern's name."""
        return self.compiled.name


def constraint_verdict(result: Any) -> str | None:
    """None when a ``var_constraints`` result accepts (a true value but a string), else the reason it
    refuses: a false value, a ``(False, "reason")`` pair, or a string, the reason itself (``""``: none).

    Raises:
        PassExecutionError: ``None`` (a constraint that forgot its ``return``), or an array of several
            elements (whose truth numpy refuses to decide).
    """
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str):
        result = True if result[0] else result[1]  # accepted, or the reason
    if result is None:
        raise PassExecutionError(
            "var_constraints returned None, which accepts nothing: the constraint has no `return` on some "
            "path; end it with `return True` (or return False / a reason string to refuse)."
        )
    if isinstance(result, np.ndarray) and result.size != 1:
        raise PassExecutionError(
            f"var_constraints returned an array of shape {result.shape}, neither true nor false; return "
            f"bool((...).all()) or bool((...).any())."
        )
    if result and not isinstance(result, str):
        return None
    return f"constraint returned False: {result}" if result else "constraint returned False"
