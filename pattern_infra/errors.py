"""Exceptions raised by the framework.

Every error a user can cause is a :class:`PatternInfraError`. Messages name the pattern, the op and the
fix; nothing is reported through ``assert`` or a silent ``False``.
"""

from __future__ import annotations

__all__ = [
    "PatternInfraError",
    "PatternDefinitionError",
    "PassRegistrationError",
    "PassExecutionError",
    "FixpointError",
    "UnsupportedOpError",
    "VerificationError",
]


class PatternInfraError(Exception):
    """Base class of every error this project raises on purpose."""


class PatternDefinitionError(PatternInfraError, ValueError):
    """A pattern program breaks one of the documented rules (names, last ops, unused inputs, ...)."""


class PassRegistrationError(PatternInfraError, ValueError):
    """A registration is inconsistent (bad pass id, unknown option, conflicting priority, ...)."""


class PassExecutionError(PatternInfraError, RuntimeError):
    """A user callback raised while a pass ran; the program was restored to its state before the pass."""


class FixpointError(PatternInfraError, RuntimeError):
    """A pass kept finding its own pattern after rewriting it, past the iteration cap."""


class UnsupportedOpError(PatternInfraError, NotImplementedError):
    """The reference evaluator met an op it has no semantics for; it never guesses."""


class VerificationError(PatternInfraError, AssertionError):
    """A rewrite changed what the program computes beyond the tolerance."""
