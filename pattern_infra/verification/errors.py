"""The errors of the verification tools: the reference evaluator, ``verify_pass``, ``prove_equivalent``."""

from typing import Any

from pattern_infra.language.errors import PatternInfraError

__all__ = ["EvaluationError", "NotElementwiseError", "UnsupportedOpError", "VerificationError"]


class UnsupportedOpError(PatternInfraError, NotImplementedError):
    """The reference evaluator met an op it has no semantics for; it never guesses."""


class VerificationError(PatternInfraError, AssertionError):
    """A rewrite changed what the program computes beyond the tolerance."""

    report: Any
    """The report of the comparison, set by ``verify_pass`` and ``check_equivalent`` where values were
    compared (read it with ``getattr(error, "report", None)``)."""


class EvaluationError(PatternInfraError, ValueError):
    """The evaluator cannot run a program as asked: inputs not matching the signature, an unknown precision,
    a semantics registered twice, an op's value contradicting its declared shape, inputs out of range."""


class NotElementwiseError(PatternInfraError, ValueError):
    """A program given to :func:`prove_equivalent` is not made only of elementwise ops."""
