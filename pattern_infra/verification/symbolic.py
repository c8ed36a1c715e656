"""Symbolic evidence that two programs compute the same thing: :func:`prove_equivalent`.

For programs made only of elementwise ops, each output becomes a sympy expression of the input symbols
(one symbol stands for one element of an input) and the difference of the two is simplified. See
:class:`ProofStatus` for exactly what each verdict claims. Numerical checks are in
:mod:`~pattern_infra.verification.verify`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import sympy as sp
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

from pattern_infra.verification.errors import NotElementwiseError
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.sympy_ops import SymOp, sym_value, symbolic_semantics
from pattern_infra.verification.verify import check_same_interface, compare_arrays, program_function

__all__ = ["OutputProof", "ProofStatus", "SymbolicResult", "prove_equivalent", "to_sympy"]

logger = logging.getLogger(__name__)

_MAX_SIMPLIFY_OPS: Final = 400  # larger differences are only expanded, not simplified


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
    func = program_function(prog, function)
    symbols = _input_symbols(func)
    env: dict[Any, sp.Basic] = {var: symbols[name] for name, var in func.inputs.items()}
    for op in func.operations:
        if op.op_type == "const":
            continue  # read lazily: a const is checked only where an elementwise op uses it
        if op.blocks:
            raise NotElementwiseError(
                f"The program is not purely elementwise: op '{op.name}' ({op.op_type}) has nested blocks."
            )
        semantics = symbolic_semantics(op.op_type)
        if semantics is None:
            if all(var.val is not None for var in op.outputs):
                continue  # a compile-time value, read lazily like a const
            raise NotElementwiseError(
                f"The program is not purely elementwise: op '{op.name}' of type '{op.op_type}' has no "
                "elementwise symbolic translation."
            )
        env[op.outputs[0]] = sp.sympify(semantics(SymOp(op, env)))
    return {var.name: sym_value(var, env, f"function output '{var.name}'") for var in func.outputs}


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
        (r for r in expr.atoms(sp.Rational) if not r.is_Integer and r not in candidate_set),
        key=sp.default_sort_key,
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


def _coefficient_gap(
    difference: sp.Basic, sides: Sequence[sp.Basic], symbols: Sequence[sp.Symbol]
) -> float | None:
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
    snapped_a, subs_a = _snap_constants(
        sp.expand(expr_a), _constant_candidates(sp.expand(expr_b), symbols), constant_rtol
    )
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
    func_a, func_b = program_function(prog_a, function), program_function(prog_b, function)
    check_same_interface(func_a, func_b, "the second program")
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
                _, _, violation = compare_arrays(out_a[i], out_b[i], rtol, atol)
                if violation.size and float(violation.max()) > 1.0:
                    flat = int(np.argmax(violation))
                    where = {name: float(values.reshape(-1)[0]) for name, values in point.items()}
                    found[i] = (where, float(np.ravel(out_a[i])[flat]), float(np.ravel(out_b[i])[flat]))
        for i in pending:
            old = proofs[i]
            if i in found:
                where, value_a, value_b = found[i]
                proofs[i] = OutputProof(
                    old.name,
                    ProofStatus.COUNTEREXAMPLE,
                    old.expr_a,
                    old.expr_b,
                    old.residual,
                    substitutions=old.substitutions,
                    counterexample=where,
                    value_a=value_a,
                    value_b=value_b,
                    samples=len(points),
                )
            else:
                proofs[i] = OutputProof(
                    old.name,
                    ProofStatus.NOT_PROVEN,
                    old.expr_a,
                    old.expr_b,
                    old.residual,
                    substitutions=old.substitutions,
                    samples=len(points),
                )
    status = min((p.status for p in proofs), key=_STATUS_RANK.__getitem__, default=ProofStatus.PROVEN)
    logger.debug("prove_equivalent: %s", status.value)
    return SymbolicResult(status=status, outputs=tuple(proofs))
