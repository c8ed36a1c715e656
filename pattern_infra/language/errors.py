"""Exceptions raised by the framework: every error a user can cause is a :class:`PatternInfraError`, its
message naming the pattern, the op and the fix."""

__all__ = [
    "PatternInfraError",
    "PatternDefinitionError",
    "PassRegistrationError",
    "PassExecutionError",
    "FixpointError",
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
