"""Pattern-rewriting framework for Core ML's MIL.

Write the sequence to find as an ``mb.program`` with uniquely named ops, write ``var_constraints`` and
``transform_pattern`` taking a :class:`Pattern`, and call :func:`register_generic_pass`. Importing this
package registers nothing; ``import generic_passes`` registers the project's passes.
"""

from .cli.quiet import held_import_warnings as _held_import_warnings

with _held_import_warnings():  # shown at once, except in the command line (see pattern_infra.cli.quiet)
    import coremltools  # noqa: F401

from .authoring import predicates
from .authoring.design import detect_pattern, lists_op_equality, pattern_detected
from .authoring.find import find_matches, fuse_all_blocks, fuse_one_block
from .authoring.rewrite import replace_with
from .inspecting.explain import Explanation, Explanations, explain
from .inspecting.suggest import Candidate, suggest
from .inspecting.tracing import Rewrite, Trace, trace
from .language.choices import one_of, optional
from .language.compiler import COMMUTATIVE_OPS, CompiledPattern, ConstRule, compile_pattern
from .language.errors import (
    FixpointError,
    PassExecutionError,
    PassRegistrationError,
    PatternDefinitionError,
    PatternInfraError,
)
from .language.pattern import Pattern
from .matching.matcher import Failure, Matcher
from .passes.container import ENV_VAR, PassContainer, override, override_enabled, run_log
from .passes.registry import generic_passes, register_generic_pass, register_graph_pass
from .passes.sweep import GenericSweep, pipeline
from .pytorch.from_torch import TorchCapture, capture_torch, pattern_from_torch
from .rewriting.removal import remove_dead_ops
from .rewriting.subpass import DEFAULT_MAX_ITERATIONS, PassStats, SubPass
from .verification.errors import EvaluationError, NotElementwiseError, UnsupportedOpError, VerificationError

__all__ = [
    "EvaluationError",
    "NotElementwiseError",
    "assert_programs_equivalent",
    "evaluate",
    "prove_equivalent",
    "register_op_semantics",
    "verify_pass",
    "COMMUTATIVE_OPS",
    "CompiledPattern",
    "ConstRule",
    "DEFAULT_MAX_ITERATIONS",
    "ENV_VAR",
    "Explanation",
    "TorchCapture",
    "one_of",
    "optional",
    "capture_torch",
    "pattern_from_torch",
    "check_torch_rewrite",
    "register_torch_rewrite",
    "Explanations",
    "Failure",
    "GenericSweep",
    "FixpointError",
    "Matcher",
    "PassContainer",
    "PassExecutionError",
    "PassRegistrationError",
    "PassStats",
    "Pattern",
    "PatternDefinitionError",
    "PatternInfraError",
    "SubPass",
    "UnsupportedOpError",
    "VerificationError",
    "compile_pattern",
    "detect_pattern",
    "explain",
    "explain_in_conversion",
    "find_matches",
    "fuse_all_blocks",
    "fuse_one_block",
    "generic_passes",
    "lists_op_equality",
    "override",
    "override_enabled",
    "pattern_program",
    "program_before",
    "pattern_detected",
    "pipeline",
    "predicates",
    "register_generic_pass",
    "register_graph_pass",
    "remove_dead_ops",
    "replace_with",
    "Rewrite",
    "Trace",
    "trace",
    "run_log",
    "suggest",
    "Candidate",
]

_ON_USE = {
    "evaluate": "verification.evaluator",
    "register_op_semantics": "verification.evaluator",
    "assert_programs_equivalent": "verification.verify",
    "prove_equivalent": "verification.symbolic",
    "verify_pass": "verification.verify",
    "explain_in_conversion": "inspecting.in_conversion",
    "program_before": "inspecting.in_conversion",
    "check_torch_rewrite": "pytorch.torch_rewrite",
    "register_torch_rewrite": "pytorch.torch_rewrite",
    "pattern_program": "authoring.program",
}
"""Verification tooling (the numpy evaluator, sympy proofs), ``explain_in_conversion`` and
``pattern_program`` are imported on first use, not with the package: a conversion that only runs passes
never loads them (nor the command line, the report or matplotlib, which nothing here imports)."""


def __getattr__(name: str) -> object:
    module = _ON_USE.get(name)
    if module is None:
        raise AttributeError(f"module 'pattern_infra' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
