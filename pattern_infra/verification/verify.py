"""Checking that a rewrite keeps what a program computes.

Two kinds of evidence:

* **Numerical** (:func:`verify_pass`, :func:`assert_programs_equivalent`): the program and its
  rewritten copy run in the reference evaluator (float64) on several random input sets; every output
  element must satisfy ``|b - a| <= atol + rtol * |a|`` where ``a`` is the original's value. Both
  helpers share one comparison; ``verify_pass`` adds the pass, the copy and the op counts.
* **Symbolic** (:func:`~pattern_infra.verification.symbolic.prove_equivalent`, in
  :mod:`~pattern_infra.verification.symbolic`): sympy proofs for programs of elementwise ops.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra.authoring.clone import clone_program
from pattern_infra.language.compiler import require_program
from pattern_infra.language.errors import PassRegistrationError
from pattern_infra.verification.errors import EvaluationError, NotElementwiseError, VerificationError
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.inputs import random_inputs

__all__ = [
    "EquivalenceReport",
    "NotElementwiseError",
    "OutputDifference",
    "VerificationReport",
    "assert_programs_equivalent",
    "check_same_interface",
    "compare_arrays",
    "count_ops",
    "program_function",
    "random_inputs",
    "verify_pass",
]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Program utilities
# --------------------------------------------------------------------------------------------------


def program_function(prog: Any, function: str) -> Any:
    """The function ``function`` of ``prog`` (a program, checked as every entry point checks one)."""
    if not hasattr(prog, "functions"):
        require_program(prog, where="verification", what="the program")
    if function not in prog.functions:
        raise EvaluationError(f"The program has no function '{function}'; it has {sorted(prog.functions)}.")
    return prog.functions[function]


def _walk_ops(block: Any) -> Iterator[Any]:
    """Ops of a block in program order, each followed by the ops of its nested blocks."""
    for op in block.operations:
        yield op
        for nested in op.blocks:
            yield from _walk_ops(nested)


def count_ops(prog: Any, *, function: str = "main") -> Counter[str]:
    """Count op types in one function, nested blocks included, in order of first appearance.

    Args:
        prog: A coremltools ``Program``.
        function: The function to count.

    Returns:
        A ``Counter`` from op type to number of ops.
    """
    return Counter(op.op_type for op in _walk_ops(program_function(prog, function)))


# --------------------------------------------------------------------------------------------------
# Numerical equivalence
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputDifference:
    """How one output of the second program differs from the first over all trials."""

    name: str
    """Output var name in the first (reference) program."""
    other_name: str
    """Output var name in the second program."""
    max_abs_diff: float
    """Largest ``|b - a|`` over all elements and trials."""
    max_rel_diff: float
    """Largest ``|b - a| / |a|`` over elements with ``|a| > atol``."""
    violation: float
    """Largest ``|b - a| / (atol + rtol * |a|)``; above 1 means out of tolerance."""
    trial: int
    """Trial where ``violation`` is largest."""
    index: tuple[int, ...]
    """Element index where ``violation`` is largest."""
    expected: float
    """Reference value at that element."""
    actual: float
    """Second program's value at that element."""


@dataclass(frozen=True)
class EquivalenceReport:
    """Result of comparing two programs numerically."""

    passed: bool
    """Every output element of every trial is within tolerance."""
    trials: int
    """Number of input sets compared."""
    rtol: float
    """Relative tolerance used."""
    atol: float
    """Absolute tolerance used."""
    max_abs_diff: float
    """Largest absolute difference over all outputs."""
    max_rel_diff: float
    """Largest relative difference over all outputs (elements with ``|a| > atol``)."""
    outputs: tuple[OutputDifference, ...]
    """Per output, in output order."""

    @property
    def worst(self) -> OutputDifference | None:
        """The output with the largest violation, or ``None`` for a program without outputs."""
        return max(self.outputs, key=lambda d: d.violation, default=None)


def compare_arrays(
    expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float
) -> tuple[np.ndarray, ...]:
    """Elementwise absolute difference, relative difference and violation ratio (NaN == NaN)."""
    a = np.asarray(expected, dtype=np.float64)
    b = np.asarray(actual, dtype=np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    magnitude = np.abs(a)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        abs_diff = np.where(same, 0.0, np.abs(b - a))
        abs_diff = np.where(np.isnan(abs_diff), np.inf, abs_diff)
        rel_diff = np.where(magnitude > atol, abs_diff / magnitude, 0.0)
        violation = abs_diff / (atol + rtol * np.where(np.isfinite(magnitude), magnitude, 0.0))
    violation = np.where(same, 0.0, violation)
    return abs_diff, np.nan_to_num(rel_diff, nan=np.inf), np.nan_to_num(violation, nan=np.inf)


def _input_sets(
    prog: Any,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
    trials: int,
    seed: int,
    function: str,
    sizes_for_symbols: Mapping[Any, int] | None,
) -> list[Mapping[str, Any]]:
    if inputs is None:
        return [
            random_inputs(prog, seed=seed + t, function=function, sizes_for_symbols=sizes_for_symbols)
            for t in range(trials)
        ]
    if isinstance(inputs, Mapping):
        return [inputs]
    return list(inputs)


def check_same_interface(func_a: Any, func_b: Any, label: str) -> None:
    if list(func_a.inputs) != list(func_b.inputs):
        raise VerificationError(
            f"{label} changed the function inputs from {list(func_a.inputs)} to {list(func_b.inputs)}."
        )
    if len(func_a.outputs) != len(func_b.outputs):
        raise VerificationError(
            f"{label} changed the number of outputs from {len(func_a.outputs)} to {len(func_b.outputs)} "
            f"({[v.name for v in func_a.outputs]} -> {[v.name for v in func_b.outputs]})."
        )


def assert_programs_equivalent(
    prog_a: Any,
    prog_b: Any,
    *,
    trials: int = 3,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    function: str = "main",
    sizes_for_symbols: Mapping[Any, int] | None = None,
    label: str = "the second program",
) -> EquivalenceReport:
    """Check numerically that ``prog_b`` computes what ``prog_a`` computes.

    Both programs run in the reference evaluator in float64 on the same inputs; outputs are matched
    by position. An element passes when ``|b - a| <= atol + rtol * |a|`` (``a`` from ``prog_a``);
    NaN matches NaN and an infinity matches the same infinity.

    Args:
        prog_a: The reference program.
        prog_b: The program under test (e.g. after a rewrite).
        trials: Number of random input sets (ignored when ``inputs`` is given).
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        seed: Seed of the first random input set; trial ``t`` uses ``seed + t``.
        inputs: Explicit input set(s) instead of random ones.
        function: The function to compare.
        sizes_for_symbols: Sizes of symbolic dimensions for random inputs (see :func:`random_inputs`).
        label: How error messages name ``prog_b`` (e.g. ``"pass 'common::fuse_gelu_exact'"``).

    Returns:
        The report (``passed`` is true).

    Raises:
        VerificationError: The interfaces differ, an output shape differs, or an element is out of
            tolerance. The :class:`EquivalenceReport` is attached as ``error.report`` when values
            were compared.
    """
    func_a, func_b = program_function(prog_a, function), program_function(prog_b, function)
    check_same_interface(func_a, func_b, label)
    input_sets = _input_sets(prog_a, inputs, trials, seed, function, sizes_for_symbols)
    names_a = [v.name for v in func_a.outputs]
    names_b = [v.name for v in func_b.outputs]
    stats: list[dict[str, Any]] = [
        {"abs": 0.0, "rel": 0.0, "violation": -1.0, "trial": 0, "index": (), "expected": 0.0, "actual": 0.0}
        for _ in names_a
    ]
    for trial, values in enumerate(input_sets):
        expected = list(evaluate(prog_a, values, function=function).values())
        actual = list(evaluate(prog_b, values, function=function).values())
        for position, (a, b) in enumerate(zip(expected, actual)):
            if np.shape(a) != np.shape(b):
                raise VerificationError(
                    f"{label} changed the shape of output '{names_a[position]}' from {np.shape(a)} "
                    f"to {np.shape(b)} (trial {trial})."
                )
            abs_diff, rel_diff, violation = compare_arrays(a, b, rtol, atol)
            entry = stats[position]
            if abs_diff.size == 0:
                continue
            entry["abs"] = max(entry["abs"], float(abs_diff.max()))
            entry["rel"] = max(entry["rel"], float(rel_diff.max()))
            flat = int(np.argmax(violation))
            if float(violation.flat[flat]) > entry["violation"]:
                index = tuple(int(i) for i in np.unravel_index(flat, violation.shape))
                entry.update(
                    violation=float(violation.flat[flat]),
                    trial=trial,
                    index=index,
                    expected=float(np.asarray(a, dtype=np.float64)[index]),
                    actual=float(np.asarray(b, dtype=np.float64)[index]),
                )
    outputs = tuple(
        OutputDifference(
            name=name_a,
            other_name=name_b,
            max_abs_diff=entry["abs"],
            max_rel_diff=entry["rel"],
            violation=max(entry["violation"], 0.0),
            trial=entry["trial"],
            index=entry["index"],
            expected=entry["expected"],
            actual=entry["actual"],
        )
        for name_a, name_b, entry in zip(names_a, names_b, stats)
    )
    report = EquivalenceReport(
        passed=all(d.violation <= 1.0 for d in outputs),
        trials=len(input_sets),
        rtol=rtol,
        atol=atol,
        max_abs_diff=max((d.max_abs_diff for d in outputs), default=0.0),
        max_rel_diff=max((d.max_rel_diff for d in outputs), default=0.0),
        outputs=outputs,
    )
    if not report.passed:
        worst = max(outputs, key=lambda d: d.violation)  # a failed report has outputs
        error = VerificationError(
            f"{label} changed what the program computes: output '{worst.name}' differs by "
            f"{worst.max_abs_diff:.6g} (expected {worst.expected:.9g}, got {worst.actual:.9g} at index "
            f"{worst.index} in trial {worst.trial}; tolerance atol={atol:g} + rtol={rtol:g}*|expected|). "
            f"Largest differences over all outputs: abs {report.max_abs_diff:.6g}, "
            f"rel {report.max_rel_diff:.6g}."
        )
        error.report = report
        raise error
    return report


@dataclass(frozen=True)
class VerificationReport:
    """Result of :func:`verify_pass`."""

    pass_name: str
    """The pass id, or the name of the callable."""
    passed: bool
    """The rewritten program matched the original on every trial."""
    max_abs_diff: float
    """Largest absolute output difference."""
    max_rel_diff: float
    """Largest relative output difference (elements with ``|a| > atol``)."""
    op_counts_before: Counter[str]
    """Op types of the original program (nested blocks included)."""
    op_counts_after: Counter[str]
    """Op types of the rewritten copy."""
    rewrites: int | None
    """Rewrites the generic passes made (0: nothing matched); None for a pass that is not generic
    (coremltools' own, a plain function), whose rewrites are not counted."""
    transformed: Any = field(repr=False)
    """The rewritten copy of the program (left out of the repr, which stays one short line)."""
    equivalence: EquivalenceReport = field(repr=False)
    """The full numerical comparison."""

    @property
    def changed(self) -> bool:
        """Whether the pass changed the op counts."""
        return self.op_counts_before != self.op_counts_after

    def __str__(self) -> str:
        done = {None: "rewrites unknown", 0: "0 rewrites: nothing matched", 1: "1 rewrite"}
        rewrites = done.get(self.rewrites, f"{self.rewrites} rewrites")
        verdict = "passed" if self.passed else "FAILED"
        return f"pass '{self.pass_name}' {verdict}: {rewrites}, max |diff| {self.max_abs_diff:.3g}"


def _resolve_pass(graph_pass: Any) -> tuple[Callable[[Any], Any], str]:
    if isinstance(graph_pass, str):
        if graph_pass not in PASS_REGISTRY:
            raise PassRegistrationError(
                f"No pass '{graph_pass}' in coremltools' PASS_REGISTRY; pass ids look like "
                "'common::fuse_gelu_exact'."
            )
        return PASS_REGISTRY[graph_pass], graph_pass
    if not callable(graph_pass):
        raise PassRegistrationError(
            f"verify_pass needs a callable taking a Program or a pass id string, got {graph_pass!r}."
        )
    name = getattr(graph_pass, "pass_name", None) or getattr(graph_pass, "__name__", None) or str(graph_pass)
    return graph_pass, str(name)


def verify_pass(
    graph_pass: Any,
    prog: Any,
    *,
    trials: int = 3,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    function: str = "main",
    sizes_for_symbols: Mapping[Any, int] | None = None,
    require_rewrite: bool = False,
) -> VerificationReport:
    """Apply a graph pass to a copy of ``prog`` and check the copy computes the same outputs.

    The report counts the rewrites of the generic passes that ran (``report.rewrites``, 0 when nothing
    matched: a pass that passes by doing nothing says so).

    Args:
        graph_pass: A callable taking a ``Program`` (an ``AbstractGraphPass`` instance, a
            ``PassContainer``, a function), or a pass id registered in coremltools' ``PASS_REGISTRY``
            such as ``"common::fuse_gelu_exact"``. A callable may rewrite in place or return a new
            program.
        prog: The program; it is not modified.
        trials: Number of random input sets.
        rtol: Relative tolerance (see :func:`assert_programs_equivalent`).
        atol: Absolute tolerance.
        seed: Seed of the random inputs.
        inputs: Explicit input set(s) instead of random ones.
        function: The function to compare.
        sizes_for_symbols: Sizes of symbolic dimensions for random inputs.
        require_rewrite: Fail when the pass rewrote nothing (for a pass that is not generic: when the
            program it leaves prints as the original).

    Returns:
        The report, with the rewritten copy as ``report.transformed``.

    Raises:
        PassRegistrationError: ``graph_pass`` is an unknown pass id or not callable.
        VerificationError: The rewritten program differs beyond tolerance, or ``require_rewrite`` and
            nothing was rewritten; the message names the pass (and the output and the largest
            difference), and ``error.report`` is the :class:`VerificationReport`.
    """
    from pattern_infra.passes.container import run_log

    apply, name = _resolve_pass(graph_pass)
    before = count_ops(prog, function=function)
    transformed = clone_program(prog)
    logged = run_log()
    returned = apply(transformed)
    if returned is not None and hasattr(returned, "functions"):
        transformed = returned
    after = count_ops(transformed, function=function)
    rewrites = _rewrites_since(logged, run_log())
    logger.debug("pass %s: %s -> %s", name, dict(before), dict(after))

    def report_of(equivalence: EquivalenceReport) -> VerificationReport:
        return VerificationReport(
            pass_name=name,
            passed=equivalence.passed,
            max_abs_diff=equivalence.max_abs_diff,
            max_rel_diff=equivalence.max_rel_diff,
            op_counts_before=before,
            op_counts_after=after,
            rewrites=rewrites,
            transformed=transformed,
            equivalence=equivalence,
        )

    try:
        equivalence = assert_programs_equivalent(
            prog,
            transformed,
            trials=trials,
            rtol=rtol,
            atol=atol,
            seed=seed,
            inputs=inputs,
            function=function,
            sizes_for_symbols=sizes_for_symbols,
            label=f"pass '{name}'",
        )
    except VerificationError as error:
        compared = getattr(error, "report", None)
        if compared is not None:
            error.report = report_of(compared)
        raise
    report = report_of(equivalence)
    if require_rewrite and (rewrites == 0 or rewrites is None and str(prog) == str(transformed)):
        unchanged = VerificationError(
            f"pass '{name}' rewrote nothing in the program (require_rewrite=True): no match was found or "
            f"every match was refused; explain(pattern, prog) shows the nearest partial matches."
        )
        unchanged.report = report
        raise unchanged
    return report


def _rewrites_since(earlier: list[Any], now: list[Any]) -> int | None:
    """Rewrites of the generic runs logged in ``now`` after ``earlier``'s entries; None if none ran."""
    start = len(earlier)
    if earlier:  # the log keeps its last entries only: find where the earlier log ended
        last = earlier[-1]
        start = next((i + 1 for i in range(len(now) - 1, -1, -1) if now[i] is last), 0)
    runs = now[start:]
    return sum(stats.rewrites for _, _, stats in runs) if runs else None
