"""Checking that a rewrite keeps what a program computes.

Two kinds of evidence:

* **Numerical** (:func:`verify_pass`, :func:`assert_programs_equivalent`): the program and its
  rewritten copy run in the reference evaluator (float64) on several random input sets; every output
  element must satisfy ``|b - a| <= atol + rtol * |a|`` where ``a`` is the original's value. Both
  helpers share one comparison; ``verify_pass`` adds the pass, the copy and the op counts.
* **Symbolic** (:func:`prove_equivalent`): for programs made only of elementwise ops, each output
  becomes a sympy expression of the input symbols (one symbol stands for one element of an input) and
  the difference of the two is simplified. See :class:`ProofStatus` for exactly what each verdict
  claims.

Copying a program: ``copy.deepcopy`` works on coremltools programs (coremltools' own pass tests rely
on it) but recurses about 15 Python frames per op along a dependency chain, so a chain of about 65
ops already exceeds Python's default recursion limit, and a few thousand ops overflow a default
thread stack (a segmentation fault, not an exception). :func:`clone_program` therefore runs the deep copy on a worker thread whose stack and
recursion limit grow with the op count.
"""

from __future__ import annotations

import copy
import enum
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import sympy as sp
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra.errors import (
    EvaluationError,
    NotElementwiseError,
    PassRegistrationError,
    PatternInfraError,
    VerificationError,
)
from pattern_infra.verification.evaluator import evaluate

__all__ = [
    "EquivalenceReport",
    "NotElementwiseError",
    "OutputDifference",
    "OutputProof",
    "ProofStatus",
    "SymbolicResult",
    "VerificationReport",
    "assert_programs_equivalent",
    "clone_program",
    "count_ops",
    "prove_equivalent",
    "random_inputs",
    "to_sympy",
    "verify_pass",
]

logger = logging.getLogger(__name__)

_DEFAULT_SYMBOL_SIZES: Final = (3, 4, 5, 2, 6, 7)
_INT_INPUT_HIGH: Final = 4  # random integer inputs are drawn from [0, 4)
_CLONE_BASE_STACK: Final = 32 * 1024 * 1024
_CLONE_STACK_PER_OP: Final = 8 * 1024
_CLONE_MAX_STACK: Final = 1024 * 1024 * 1024
_CLONE_FRAMES_PER_OP: Final = 40
_MAX_SIMPLIFY_OPS: Final = 400  # larger differences are only expanded, not simplified


# --------------------------------------------------------------------------------------------------
# Program utilities
# --------------------------------------------------------------------------------------------------


def _function(prog: Any, function: str) -> Any:
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
    return Counter(op.op_type for op in _walk_ops(_function(prog, function)))


def clone_program(prog: Any) -> Any:
    """Return an independent deep copy of a coremltools ``Program``.

    The copy shares no op, var or block with the original, so a pass applied to it leaves the
    original untouched. See the module docstring for why the copy runs on a worker thread.

    Args:
        prog: The program to copy.

    Returns:
        The copy.
    """
    n_ops = sum(1 for func in prog.functions.values() for _ in _walk_ops(func))
    stack = min(_CLONE_BASE_STACK + _CLONE_STACK_PER_OP * n_ops, _CLONE_MAX_STACK)
    limit = max(sys.getrecursionlimit(), 10_000 + _CLONE_FRAMES_PER_OP * n_ops)
    result: list[Any] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            result.append(copy.deepcopy(prog))
        except BaseException as exc:  # re-raised on the calling thread below
            failure.append(exc)

    old_limit = sys.getrecursionlimit()
    old_stack = threading.stack_size()
    try:
        sys.setrecursionlimit(limit)
        threading.stack_size(stack)
        worker = threading.Thread(target=work, name="pattern_infra-clone_program")
        worker.start()
        worker.join()
    finally:
        threading.stack_size(old_stack)
        sys.setrecursionlimit(old_limit)
    if failure:
        raise failure[0]
    return result[0]


def random_inputs(
    prog: Any,
    *,
    seed: int = 0,
    function: str = "main",
    sizes_for_symbols: Mapping[Any, int] | None = None,
) -> dict[str, np.ndarray]:
    """Draw one random value per function input, with the declared shapes and dtypes.

    Floating inputs come from a standard normal distribution, integer inputs uniformly from
    ``[0, 4)``, booleans are fair coin flips. A symbolic dimension becomes a small concrete size;
    every occurrence of the same symbol gets the same size. Deterministic for a given seed.

    Args:
        prog: A coremltools ``Program``.
        seed: Seed of the numpy generator.
        function: The function whose inputs are drawn.
        sizes_for_symbols: Sizes for symbolic dimensions, keyed by symbol (or its name, e.g.
            ``"is0"``). Unlisted symbols get sizes 3, 4, 5, 2, 6, 7, ... in order of first use.

    Returns:
        One array per input, keyed by input name, in the function's input order.

    Raises:
        EvaluationError: An input has a type that is neither a float, integer nor bool tensor.
    """
    func = _function(prog, function)
    rng = np.random.default_rng(seed)
    sizes = {str(key): int(value) for key, value in (sizes_for_symbols or {}).items()}
    defaults_used = 0
    arrays: dict[str, np.ndarray] = {}
    for name, var in func.inputs.items():
        shape = []
        for dim in var.shape:
            if not is_symbolic(dim):
                shape.append(int(dim))
                continue
            key = str(dim)
            if key not in sizes:
                sizes[key] = _DEFAULT_SYMBOL_SIZES[defaults_used % len(_DEFAULT_SYMBOL_SIZES)]
                defaults_used += 1
            shape.append(sizes[key])
        dtype = var.dtype
        np_type = np.dtype(types.nptype_from_builtin(dtype))
        if types.is_float(dtype):
            arrays[name] = rng.standard_normal(shape).astype(np_type)
        elif types.is_bool(dtype):
            arrays[name] = rng.random(shape) < 0.5
        elif types.is_int(dtype):
            arrays[name] = rng.integers(0, _INT_INPUT_HIGH, size=shape).astype(np_type)
        else:
            raise EvaluationError(
                f"Input '{name}' has type {types.builtin_to_string(dtype)}; random_inputs draws float, "
                "integer and bool tensors only. Pass inputs explicitly."
            )
    return arrays


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


def _compare_arrays(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float) -> tuple[np.ndarray, ...]:
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


def _check_same_interface(func_a: Any, func_b: Any, label: str) -> None:
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
    func_a, func_b = _function(prog_a, function), _function(prog_b, function)
    _check_same_interface(func_a, func_b, label)
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
            abs_diff, rel_diff, violation = _compare_arrays(a, b, rtol, atol)
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
        error.report = report  # type: ignore[attr-defined]
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
    transformed: Any
    """The rewritten copy of the program."""
    equivalence: EquivalenceReport = field(repr=False)
    """The full numerical comparison."""

    @property
    def changed(self) -> bool:
        """Whether the pass changed the op counts."""
        return self.op_counts_before != self.op_counts_after


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
) -> VerificationReport:
    """Apply a graph pass to a copy of ``prog`` and check the copy computes the same outputs.

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

    Returns:
        The report, with the rewritten copy as ``report.transformed``.

    Raises:
        PassRegistrationError: ``graph_pass`` is an unknown pass id or not callable.
        VerificationError: The rewritten program differs beyond tolerance; the message names the
            pass, the output and the largest difference, and ``error.report`` is the
            :class:`VerificationReport`.
    """
    apply, name = _resolve_pass(graph_pass)
    before = count_ops(prog, function=function)
    transformed = clone_program(prog)
    returned = apply(transformed)
    if returned is not None and hasattr(returned, "functions"):
        transformed = returned
    after = count_ops(transformed, function=function)
    logger.debug("pass %s: %s -> %s", name, dict(before), dict(after))

    def report_of(equivalence: EquivalenceReport) -> VerificationReport:
        return VerificationReport(
            pass_name=name,
            passed=equivalence.passed,
            max_abs_diff=equivalence.max_abs_diff,
            max_rel_diff=equivalence.max_rel_diff,
            op_counts_before=before,
            op_counts_after=after,
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
            error.report = report_of(compared)  # type: ignore[attr-defined]
        raise
    return report_of(equivalence)


# --------------------------------------------------------------------------------------------------
# Symbolic equivalence
# --------------------------------------------------------------------------------------------------


class ProofStatus(enum.Enum):
    """Verdict of :func:`prove_equivalent` for one output (or the weakest over all outputs).

    Every verdict is about the programs as real functions of real inputs (exact arithmetic; the
    rounding of intermediate results is not modelled), one symbol standing for one element of each
    input.
    """

    PROVEN = "proven"
    """With every constant taken at its exact stored (binary) value, sympy reduces the difference
    of the two outputs to 0: they are the same function wherever both are defined (up to what
    sympy's simplification cancels, e.g. the removable singularity of ``x / x``)."""
    PROVEN_UP_TO_ROUNDING = "proven_up_to_rounding"
    """Not exactly equal, but equal once constants are identified with nearby ones: either replacing
    constants of one side by constant subexpressions of the other side, each within
    ``constant_rtol`` relative (the substitutions are listed), makes the difference 0; or the
    expanded difference is a sum of terms whose coefficients are all at most ``constant_rtol`` times
    the largest coefficient of either side. This is what "the pattern uses float32-rounded
    constants" looks like (0.044714998453855515 for 0.044715). It bounds the perturbation of the
    constants (``constant_gap``), not the difference of the outputs for all inputs."""
    NOT_PROVEN = "not_proven"
    """sympy could not reduce the difference, and the two programs agree (within ``rtol``/``atol``)
    at every sampled point. Evidence, not proof."""
    COUNTEREXAMPLE = "counterexample"
    """sympy could not reduce the difference, and at the reported point the reference evaluator's
    outputs differ by more than ``atol + rtol * |a|``: the programs are not equivalent."""


_STATUS_RANK: Final = {
    ProofStatus.COUNTEREXAMPLE: 0,
    ProofStatus.NOT_PROVEN: 1,
    ProofStatus.PROVEN_UP_TO_ROUNDING: 2,
    ProofStatus.PROVEN: 3,
}


@dataclass(frozen=True)
class OutputProof:
    """Verdict for one output."""

    name: str
    """Output var name in the first program."""
    status: ProofStatus
    """The verdict."""
    expr_a: sp.Basic
    """The output of the first program as a sympy expression."""
    expr_b: sp.Basic
    """The output of the second program as a sympy expression."""
    residual: sp.Basic
    """The simplified difference that was examined last (0 for the proven verdicts)."""
    constant_gap: float = 0.0
    """For ``PROVEN_UP_TO_ROUNDING``: the largest relative gap between identified constants."""
    substitutions: tuple[tuple[sp.Basic, sp.Basic, float], ...] = ()
    """Constants replaced as ``(constant, replacement, relative gap)``."""
    counterexample: Mapping[str, float] | None = None
    """For ``COUNTEREXAMPLE``: input values where the outputs differ."""
    value_a: float | None = None
    """First program's output at the counterexample."""
    value_b: float | None = None
    """Second program's output at the counterexample."""
    samples: int = 0
    """Number of points evaluated numerically (0 when sympy decided)."""


@dataclass(frozen=True)
class SymbolicResult:
    """Result of :func:`prove_equivalent`: one :class:`OutputProof` per output."""

    status: ProofStatus
    """The weakest verdict over all outputs."""
    outputs: tuple[OutputProof, ...]
    """Per output, in output order."""

    @property
    def proven(self) -> bool:
        """``PROVEN`` or ``PROVEN_UP_TO_ROUNDING`` for every output."""
        return _STATUS_RANK[self.status] >= _STATUS_RANK[ProofStatus.PROVEN_UP_TO_ROUNDING]

    @property
    def constant_gap(self) -> float:
        """The largest constant gap over all outputs."""
        return max((o.constant_gap for o in self.outputs), default=0.0)

    @property
    def counterexample(self) -> Mapping[str, float] | None:
        """The first counterexample found, if any."""
        return next((o.counterexample for o in self.outputs if o.counterexample is not None), None)

    def __str__(self) -> str:
        lines = [f"{self.status.value}"]
        for o in self.outputs:
            detail = ""
            if o.status is ProofStatus.PROVEN_UP_TO_ROUNDING:
                detail = f" (constant gap {o.constant_gap:.3g})"
            elif o.status is ProofStatus.COUNTEREXAMPLE:
                detail = f" at {dict(o.counterexample or {})}: {o.value_a!r} vs {o.value_b!r}"
            lines.append(f"  {o.name}: {o.status.value}{detail}")
        return "\n".join(lines)


def _number(value: Any) -> sp.Basic:
    """An exact sympy number for a numpy/python scalar (floats keep their exact binary value)."""
    if isinstance(value, (bool, np.bool_)):
        return sp.true if bool(value) else sp.false
    if isinstance(value, (int, np.integer)):
        return sp.Integer(int(value))
    return sp.Rational(float(value))


class _SymOp:
    """What a symbolic translation sees: the op and sympy expressions for its inputs."""

    __slots__ = ("op", "_env")

    def __init__(self, op: Any, env: Mapping[Any, sp.Basic]) -> None:
        self.op = op
        self._env = env

    def has(self, name: str) -> bool:
        return name in self.op.inputs

    def arg(self, name: str) -> sp.Basic:
        return _sym_value(self.op.inputs[name], self._env, f"op '{self.op.name}' ({self.op.op_type})")

    def attr(self, name: str, default: Any = None) -> Any:
        var = self.op.inputs.get(name)
        if var is None:
            return default
        value = var.val
        if value is None:
            raise NotElementwiseError(
                f"Op '{self.op.name}' ({self.op.op_type}): parameter '{name}' is not a compile-time value."
            )
        return value.item() if isinstance(value, np.generic) else value


def _sym_value(var: Any, env: Mapping[Any, sp.Basic], consumer: str) -> sp.Basic:
    if var in env:
        return env[var]
    value = var.val
    if value is None:
        raise NotElementwiseError(f"Var '{var.name}' used by {consumer} has no symbolic value.")
    array = np.asarray(value)
    if array.size == 0 or not np.all(array == array.reshape(-1)[0]):
        raise NotElementwiseError(
            f"The program is not purely elementwise: {consumer} uses constant '{var.name}' of shape "
            f"{array.shape} whose elements differ, so one symbol per input element cannot describe "
            "the output."
        )
    return _number(array.reshape(-1)[0])


def _default_epsilon(sym: _SymOp, default: float) -> sp.Basic:
    if sym.has("epsilon"):
        return sym.arg("epsilon")
    dtype = types.nptype_from_builtin(sym.op.inputs["x"].dtype)
    return _number(np.asarray(default, dtype=dtype).item())


def _sigmoid_expr(x: sp.Basic) -> sp.Basic:
    return 1 / (1 + sp.exp(-x))


def _truncate(x: sp.Basic) -> sp.Basic:
    return sp.Piecewise((sp.floor(x), x >= 0), (sp.ceiling(x), True))


_SYM_UNARY: Final[dict[str, Callable[[sp.Basic], sp.Basic]]] = {
    "abs": sp.Abs,
    "acos": sp.acos,
    "asin": sp.asin,
    "atan": sp.atan,
    "atanh": sp.atanh,
    "ceil": sp.ceiling,
    "cos": sp.cos,
    "cosh": sp.cosh,
    "erf": sp.erf,
    "exp": sp.exp,
    "exp2": lambda x: sp.Integer(2) ** x,
    "floor": sp.floor,
    "identity": lambda x: x,
    "logical_not": sp.Not,
    "relu": lambda x: sp.Max(x, 0),
    "relu6": lambda x: sp.Min(sp.Max(x, 0), 6),
    "sigmoid": _sigmoid_expr,
    "sign": sp.sign,
    "silu": lambda x: x * _sigmoid_expr(x),
    "sin": sp.sin,
    "sinh": sp.sinh,
    "softplus": lambda x: sp.log(1 + sp.exp(x)),
    "softsign": lambda x: x / (1 + sp.Abs(x)),
    "sqrt": sp.sqrt,
    "square": lambda x: x**2,
    "tan": sp.tan,
    "tanh": sp.tanh,
}

_SYM_BINARY: Final[dict[str, Callable[[sp.Basic, sp.Basic], sp.Basic]]] = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "real_div": lambda x, y: x / y,
    "pow": lambda x, y: x**y,
    "floor_div": lambda x, y: sp.floor(x / y),
    "mod": sp.Mod,
    "maximum": sp.Max,
    "minimum": sp.Min,
    "equal": sp.Eq,
    "not_equal": sp.Ne,
    "less": sp.Lt,
    "less_equal": sp.Le,
    "greater": sp.Gt,
    "greater_equal": sp.Ge,
    "logical_and": sp.And,
    "logical_or": sp.Or,
    "logical_xor": sp.Xor,
}


def _gelu_expr(sym: _SymOp) -> sp.Basic:
    x = sym.arg("x")
    mode = sym.attr("mode", "EXACT")
    if mode == "EXACT":
        return x / 2 * (1 + sp.erf(x / sp.sqrt(2)))
    if mode == "TANH_APPROXIMATION":
        return x / 2 * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Rational(44715, 10**6) * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x * _sigmoid_expr(sp.Rational(1702, 1000) * x)
    raise NotElementwiseError(f"Op '{sym.op.name}': unknown gelu mode {mode!r}.")


def _cast_expr(sym: _SymOp) -> sp.Basic:
    x = sym.arg("x")
    target = sym.op.outputs[0].dtype
    if types.is_float(target):
        return x
    if types.is_int(target):
        return _truncate(x)
    if types.is_bool(target):
        return sp.Ne(x, 0)
    raise NotElementwiseError(f"Op '{sym.op.name}': cast to {types.builtin_to_string(target)}.")


_SYM_OTHER: Final[dict[str, Callable[[_SymOp], sp.Basic]]] = {
    "inverse": lambda s: 1 / (s.arg("x") + _default_epsilon(s, 1e-4)),
    "log": lambda s: sp.log(s.arg("x") + _default_epsilon(s, 1e-45)),
    "rsqrt": lambda s: 1 / sp.sqrt(s.arg("x") + _default_epsilon(s, 1e-12)),
    "clip": lambda s: sp.Min(sp.Max(s.arg("x"), s.arg("alpha")), s.arg("beta")),
    "threshold": lambda s: sp.Max(s.arg("x"), s.arg("alpha")),
    "leaky_relu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") >= 0), (s.arg("alpha") * s.arg("x"), True)),
    "prelu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") > 0), (s.arg("alpha") * s.arg("x"), True)),
    "elu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") > 0), (s.arg("alpha") * (sp.exp(s.arg("x")) - 1), True)),
    "thresholded_relu": lambda s: sp.Piecewise((s.arg("x"), s.arg("x") >= s.arg("alpha")), (0, True)),
    "clamped_relu": lambda s: sp.Piecewise(
        (sp.Min(s.arg("beta"), s.arg("x")), s.arg("x") >= 0), (sp.Min(s.arg("beta"), s.arg("alpha") * s.arg("x")), True)
    ),
    "linear_activation": lambda s: s.arg("alpha") * s.arg("x") + s.arg("beta"),
    "scaled_tanh": lambda s: s.arg("alpha") * sp.tanh(s.arg("beta") * s.arg("x")),
    "sigmoid_hard": lambda s: sp.Min(sp.Max(s.arg("alpha") * s.arg("x") + s.arg("beta"), 0), 1),
    "softplus_parametric": lambda s: s.arg("alpha") * sp.log(1 + sp.exp(s.arg("beta") * s.arg("x"))),
    "gelu": _gelu_expr,
    "cast": _cast_expr,
    "select": lambda s: sp.Piecewise((s.arg("a"), s.arg("cond")), (s.arg("b"), True)),
}


def _symbolic_semantics(op_type: str) -> Callable[[_SymOp], sp.Basic] | None:
    if op_type in _SYM_UNARY:
        fn = _SYM_UNARY[op_type]
        return lambda s: fn(s.arg("x"))
    if op_type in _SYM_BINARY:
        fn2 = _SYM_BINARY[op_type]
        return lambda s: fn2(s.arg("x"), s.arg("y"))
    return _SYM_OTHER.get(op_type)


def _input_symbols(func: Any) -> dict[str, sp.Symbol]:
    symbols = {}
    for name, var in func.inputs.items():
        if types.is_float(var.dtype):
            symbols[name] = sp.Symbol(name, real=True)
        elif types.is_int(var.dtype):
            symbols[name] = sp.Symbol(name, integer=True)
        else:
            raise NotElementwiseError(
                f"Input '{name}' has type {types.builtin_to_string(var.dtype)}; symbolic proofs take "
                "float and integer inputs."
            )
    return symbols


def to_sympy(prog: Any, *, function: str = "main") -> dict[str, sp.Basic]:
    """Translate a purely elementwise program into one sympy expression per output.

    Each function input ``name`` becomes ``sympy.Symbol(name, real=True)`` (``integer=True`` for
    integer inputs) standing for one element of that input. Constants must be scalars or tensors
    whose elements are all equal; floating constants become exact rationals of their stored binary
    value (float32 0.044715 becomes 0.044714998453855515... exactly). ``gelu`` maps to its formula:
    ``EXACT`` uses ``erf``, ``TANH_APPROXIMATION`` the exact ``sqrt(2/pi)`` and ``0.044715``.

    Args:
        prog: A coremltools ``Program``.
        function: The function to translate.

    Returns:
        One expression per output, keyed by output name, in output order.

    Raises:
        NotElementwiseError: An op is not elementwise (or has no symbolic translation), a constant
            tensor has differing elements, or an input is neither float nor integer.
    """
    func = _function(prog, function)
    symbols = _input_symbols(func)
    env: dict[Any, sp.Basic] = {var: symbols[name] for name, var in func.inputs.items()}
    for op in func.operations:
        if op.op_type == "const":
            continue  # read lazily: a const is checked only where an elementwise op uses it
        if op.blocks:
            raise NotElementwiseError(
                f"The program is not purely elementwise: op '{op.name}' ({op.op_type}) has nested blocks."
            )
        semantics = _symbolic_semantics(op.op_type)
        if semantics is None:
            if all(var.val is not None for var in op.outputs):
                continue  # a compile-time value, read lazily like a const
            raise NotElementwiseError(
                f"The program is not purely elementwise: op '{op.name}' of type '{op.op_type}' has no "
                "elementwise symbolic translation."
            )
        env[op.outputs[0]] = sp.sympify(semantics(_SymOp(op, env)))
    return {var.name: _sym_value(var, env, f"function output '{var.name}'") for var in func.outputs}


def _vanishes(difference: sp.Basic) -> tuple[bool, sp.Basic]:
    """Try increasingly expensive rewrites; return whether the difference is 0 and the residual."""
    if difference == 0:
        return True, sp.Integer(0)
    expanded = sp.expand(difference)
    if expanded == 0:
        return True, expanded
    if sp.count_ops(expanded) > _MAX_SIMPLIFY_OPS:
        return False, expanded
    residual = sp.simplify(expanded)
    if residual == 0:
        return True, residual
    rewrites = [expanded.rewrite(sp.exp)]
    if expanded.has(sp.Max, sp.Min, sp.Abs, sp.sign, sp.Piecewise):
        rewrites.append(expanded.rewrite(sp.Piecewise))
    for rewritten in rewrites:
        if sp.simplify(rewritten) == 0:
            return True, sp.Integer(0)
    return False, residual


def _constant_candidates(expr: sp.Basic, symbols: Sequence[sp.Symbol]) -> list[sp.Basic]:
    """Constant subexpressions of ``expr`` and the constant coefficients of its products."""
    found: dict[sp.Basic, None] = {}
    for node in sp.preorder_traversal(expr):
        if not isinstance(node, sp.Expr):
            continue
        if node.is_number and not node.is_Integer:
            found[node] = None
        elif node.is_Mul and node.free_symbols:
            coefficient, _ = node.as_independent(*symbols, as_Add=False)
            if coefficient.is_number and not coefficient.is_Integer:
                found[coefficient] = None
    return list(found)


def _snap_constants(
    expr: sp.Basic, candidates: Sequence[sp.Basic], tolerance: float
) -> tuple[sp.Basic, list[tuple[sp.Basic, sp.Basic, float]]]:
    """Replace each non-integer rational of ``expr`` by the nearest candidate within ``tolerance``."""
    values: list[tuple[sp.Basic, float]] = []
    for candidate in candidates:
        try:
            values.append((candidate, float(sp.N(candidate, 30))))
        except TypeError:
            continue
    mapping: dict[sp.Basic, sp.Basic] = {}
    substitutions = []
    candidate_set = set(candidates)
    rationals = sorted(
        (r for r in expr.atoms(sp.Rational) if not r.is_Integer and r not in candidate_set), key=sp.default_sort_key
    )
    for constant in rationals:
        value = float(constant)
        best: tuple[float, sp.Basic] | None = None
        for candidate, candidate_value in values:
            if candidate_value == 0 or candidate == constant:
                continue
            gap = abs(value - candidate_value) / abs(candidate_value)
            if gap <= tolerance and (best is None or gap < best[0]):
                best = (gap, candidate)
        if best is not None:
            mapping[constant] = best[1]
            substitutions.append((constant, best[1], best[0]))
    return (expr.xreplace(mapping) if mapping else expr), substitutions


def _coefficient_gap(difference: sp.Basic, sides: Sequence[sp.Basic], symbols: Sequence[sp.Symbol]) -> float | None:
    """Largest |coefficient| of the expanded difference over the largest coefficient of the sides."""

    def coefficients(expr: sp.Basic) -> list[float] | None:
        result = []
        for term in sp.Add.make_args(sp.expand(expr)):
            coefficient, _ = term.as_independent(*symbols, as_Add=False)
            try:
                result.append(abs(complex(sp.N(coefficient))))
            except TypeError:
                return None
        return result

    gaps = coefficients(difference)
    scale = [c for side in sides for c in (coefficients(side) or [])]
    if gaps is None or not scale or max(scale) == 0:
        return None
    return max(gaps, default=0.0) / max(scale)


def _prove_output(
    name: str, expr_a: sp.Basic, expr_b: sp.Basic, symbols: Sequence[sp.Symbol], constant_rtol: float
) -> OutputProof:
    exact, residual = _vanishes(expr_a - expr_b)
    if exact:
        return OutputProof(name, ProofStatus.PROVEN, expr_a, expr_b, sp.Integer(0))
    # Identify constants of one side with nearby constants of the other, then retry.
    snapped_a, subs_a = _snap_constants(sp.expand(expr_a), _constant_candidates(sp.expand(expr_b), symbols), constant_rtol)
    expanded_b = sp.expand(expr_b)
    snapped_b, subs_b = _snap_constants(expanded_b, _constant_candidates(snapped_a, symbols), constant_rtol)
    substitutions = tuple(subs_a + subs_b)
    gap = max((s[2] for s in substitutions), default=0.0)
    if substitutions:
        snapped_zero, snapped_residual = _vanishes(snapped_a - snapped_b)
        if snapped_zero:
            return OutputProof(
                name, ProofStatus.PROVEN_UP_TO_ROUNDING, expr_a, expr_b, sp.Integer(0), gap, substitutions
            )
        residual = snapped_residual
    coefficient_gap = _coefficient_gap(snapped_a - snapped_b, (snapped_a, snapped_b), symbols)
    if coefficient_gap is not None and coefficient_gap <= constant_rtol:
        return OutputProof(
            name,
            ProofStatus.PROVEN_UP_TO_ROUNDING,
            expr_a,
            expr_b,
            residual,
            max(gap, coefficient_gap),
            substitutions,
        )
    return OutputProof(name, ProofStatus.NOT_PROVEN, expr_a, expr_b, residual, 0.0, substitutions)


def _sample_points(func: Any, samples: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    points = []
    for _ in range(samples):
        point = {}
        for name, var in func.inputs.items():
            shape = [1 if is_symbolic(d) else int(d) for d in var.shape]
            np_type = types.nptype_from_builtin(var.dtype)
            value = rng.normal(0.0, 2.0) if types.is_float(var.dtype) else rng.integers(-4, 5)
            point[name] = np.full(shape, value, dtype=np_type)
        points.append(point)
    return points


def prove_equivalent(
    prog_a: Any,
    prog_b: Any,
    *,
    function: str = "main",
    samples: int = 16,
    seed: int = 0,
    rtol: float = 1e-6,
    atol: float = 1e-9,
    constant_rtol: float = 1e-6,
) -> SymbolicResult:
    """Prove (or refute) that two purely elementwise programs compute the same function.

    1. Translate both programs with :func:`to_sympy` (the same input names give the same symbols).
    2. Per output: reduce ``expr_a - expr_b`` (expand, simplify, rewrite in ``exp`` / ``Piecewise``);
       0 gives ``PROVEN``.
    3. Otherwise identify nearby constants and check coefficients (see
       :attr:`ProofStatus.PROVEN_UP_TO_ROUNDING`) with ``constant_rtol``.
    4. Otherwise evaluate both programs with the reference evaluator at ``samples`` random points
       (every element of an input holds the same value, drawn from N(0, 2^2) for floats and
       [-4, 4] for integers): a point where they differ by more than ``atol + rtol * |a|`` gives
       ``COUNTEREXAMPLE``; none gives ``NOT_PROVEN``.

    Args:
        prog_a: The first program (e.g. the pattern).
        prog_b: The second program (e.g. the replacement).
        function: The function to compare in both programs.
        samples: Number of random points for the numerical step.
        seed: Seed of the random points.
        rtol: Relative tolerance of the numerical step.
        atol: Absolute tolerance of the numerical step.
        constant_rtol: Relative tolerance for identifying constants.

    Returns:
        The per-output verdicts and the weakest one.

    Raises:
        NotElementwiseError: A program is not purely elementwise.
        VerificationError: The programs have different inputs or numbers of outputs.
    """
    func_a, func_b = _function(prog_a, function), _function(prog_b, function)
    _check_same_interface(func_a, func_b, "the second program")
    exprs_a = list(to_sympy(prog_a, function=function).items())
    exprs_b = list(to_sympy(prog_b, function=function).values())
    symbols = list(_input_symbols(func_a).values())
    proofs = [
        _prove_output(name, expr_a, expr_b, symbols, constant_rtol)
        for (name, expr_a), expr_b in zip(exprs_a, exprs_b)
    ]
    pending = [i for i, proof in enumerate(proofs) if proof.status is ProofStatus.NOT_PROVEN]
    if pending:
        points = _sample_points(func_a, samples, seed)
        found: dict[int, tuple[dict[str, float], float, float]] = {}
        for point in points:
            out_a = list(evaluate(prog_a, point, function=function).values())
            out_b = list(evaluate(prog_b, point, function=function).values())
            for i in pending:
                if i in found:
                    continue
                _, _, violation = _compare_arrays(out_a[i], out_b[i], rtol, atol)
                if violation.size and float(violation.max()) > 1.0:
                    flat = int(np.argmax(violation))
                    where = {name: float(values.reshape(-1)[0]) for name, values in point.items()}
                    found[i] = (where, float(np.ravel(out_a[i])[flat]), float(np.ravel(out_b[i])[flat]))
        for i in pending:
            old = proofs[i]
            if i in found:
                where, value_a, value_b = found[i]
                proofs[i] = OutputProof(
                    old.name, ProofStatus.COUNTEREXAMPLE, old.expr_a, old.expr_b, old.residual,
                    substitutions=old.substitutions, counterexample=where, value_a=value_a,
                    value_b=value_b, samples=len(points),
                )
            else:
                proofs[i] = OutputProof(
                    old.name, ProofStatus.NOT_PROVEN, old.expr_a, old.expr_b, old.residual,
                    substitutions=old.substitutions, samples=len(points),
                )
    status = min((p.status for p in proofs), key=_STATUS_RANK.__getitem__, default=ProofStatus.PROVEN)
    logger.debug("prove_equivalent: %s", status.value)
    return SymbolicResult(status=status, outputs=tuple(proofs))

