"""Exceptions raised by the framework: every error a user can cause is a :class:`PatternInfraError`, its
message naming the pattern, the op and the fix."""

__all__ = ["PatternInfraError", "PatternDefinitionError", "PassRegistrationError", "PassExecutionError",
           "FixpointError", "UnsupportedOpError", "VerificationError", "EvaluationError", "NotElementwiseError"]


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


class EvaluationError(PatternInfraError, ValueError):
    """The evaluator cannot run a program as asked: inputs not matching the signature, an unknown precision,
    a semantics registered twice, an op's value contradicting its declared shape, inputs out of range."""


class NotElementwiseError(PatternInfraError, ValueError):
    """A program given to :func:`prove_equivalent` is not made only of elementwise ops."""
