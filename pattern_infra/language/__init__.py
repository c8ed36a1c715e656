"""The pattern language (docs/LANGUAGE.md): a pattern program compiled into a :class:`CompiledPattern`
graph, and the :class:`Pattern` a match hands to the user's callbacks. Imports nothing else of the package."""

from .choices import one_of, optional
from .compiler import compile_pattern
from .errors import (
    FixpointError,
    PassExecutionError,
    PassRegistrationError,
    PatternDefinitionError,
    PatternInfraError,
)
from .graph import COMMUTATIVE_OPS, CompiledPattern, ConstRule, Edge, PatternNode, is_compressed
from .pattern import Pattern

__all__ = [
    "COMMUTATIVE_OPS",
    "CompiledPattern",
    "ConstRule",
    "Edge",
    "FixpointError",
    "PassExecutionError",
    "PassRegistrationError",
    "Pattern",
    "PatternDefinitionError",
    "PatternInfraError",
    "PatternNode",
    "compile_pattern",
    "is_compressed",
    "one_of",
    "optional",
]
