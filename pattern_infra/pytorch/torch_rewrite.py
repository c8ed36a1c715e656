"""A rewrite written as two PyTorch functions, proven when it registers: ``register_torch_rewrite``.

::

    register_torch_rewrite(lambda x: x * torch.sigmoid(x), torch.nn.functional.silu,
                           (torch.randn(4, 8),), "fuse_silu_mine", "mine")

How (numbered as it happens):

1. Both functions are converted with :func:`~pattern_infra.capture_torch` at the same capture
   point, the replacement's inputs named after the pattern function's parameters.
2. :func:`check_torch_rewrite` compares the two captured programs with the reference evaluator on five
   draws of the example shapes (``normal``, ``zeros``, ``negatives``, ``large`` 1e4 and ``tiny`` 1e-4
   values) and, when both are elementwise ops that :mod:`~pattern_infra.verification.symbolic` knows,
   with sympy. A difference beyond ``atol + rtol * |pattern|``, or a sympy counterexample, is a
   :class:`~pattern_infra.language.errors.PatternDefinitionError` naming the largest difference and the
   input that shows it; nothing is registered.
3. The pattern is registered as :func:`~pattern_infra.passes.registry.register_generic_pass` would,
   with ``replace_with(replacement)`` as the transform (the pattern's inputs bound by name to the
   replacement's) and the other options passed through.

The capture point: ``before=`` / ``after=`` as for ``pattern_from_torch``; when neither is given, after
``run_after`` for a pass that follows one, before the pass id itself for a pass replacing a coremltools
pass, else :data:`~pattern_infra.pytorch.from_torch.DEFAULT_BEFORE`.

What the check does not claim: the draws are the example shapes (a rewrite that is right only for these
shapes passes), and a rewrite relying on a constant's value holds for that value only (register it with
``constants="value"``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline

from ..authoring.rewrite import replace_with
from ..language.errors import PatternDefinitionError
from ..passes.container import PassContainer
from ..passes.registry import register_generic_pass
from .from_torch import DEFAULT_BEFORE, capture_torch

__all__ = ["DRAWS", "RewriteCheck", "check_torch_rewrite", "register_torch_rewrite"]

logger = logging.getLogger(__name__)

DRAWS: dict[str, Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]] = {
    "normal": lambda rng, shape: rng.standard_normal(shape),
    "zeros": lambda rng, shape: np.zeros(shape),
    "negatives": lambda rng, shape: -np.abs(rng.standard_normal(shape)) - 1e-3,
    "large": lambda rng, shape: 1e4 * rng.standard_normal(shape),
    "tiny": lambda rng, shape: 1e-4 * rng.standard_normal(shape),
}
"""The input draws of the check, by name: each gives every input of the example shape its values."""

_CAPTURE_OPTIONS = ("dynamic", "minimum_deployment_target")


@dataclass(frozen=True)
class RewriteCheck:
    """What :func:`check_torch_rewrite` found (the pair is equivalent, or it would have raised)."""

    pattern: Program
    """The captured pattern program."""
    replacement: Program
    """The captured replacement program, inputs named as the pattern's."""
    point: str
    """The capture point in words."""
    draws: tuple[str, ...]
    """The input draws compared, in order."""
    max_abs_diff: float
    """Largest ``|replacement - pattern|`` over all outputs and draws."""
    max_rel_diff: float
    """Largest relative difference over all outputs and draws."""
    symbolic: str
    """The sympy verdict (``"proven"``, ``"proven_up_to_rounding"``, ``"not_proven"``) or why there is
    none (``"not elementwise: ..."``)."""


def _capture_point(
    pass_name: str, namespace: str, before: str | None, after: str | None, run_after: str | None
) -> dict[str, str]:
    if before is not None or after is not None:
        return {k: v for k, v in (("before", before), ("after", after)) if v is not None}
    if run_after is not None:
        return {"after": run_after}
    pass_id = f"{namespace}::{pass_name}"
    if (
        pass_id in PassPipeline.DEFAULT.passes
        or pass_id in PassPipeline.get_pipeline("backend_mlprogram").passes
    ):
        return {"before": pass_id}
    return {"before": DEFAULT_BEFORE}


def check_torch_rewrite(
    pattern_fn: Callable[..., Any],
    replacement_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    seed: int = 0,
    label: str = "torch rewrite",
    **capture: Any,
) -> RewriteCheck:
    """Captures both functions and checks that they compute the same thing.

    Args:
        pattern_fn: The PyTorch function the rewrite finds.
        replacement_fn: The PyTorch function it becomes (same positional arguments).
        example_inputs: One example tensor per argument: its shape is the shape of every draw.
        rtol: Relative tolerance of the numerical comparison: state the error of an approximation you
            mean (e.g. ``1e-3`` for tanh GELU in place of the exact one).
        atol: Absolute tolerance of the numerical comparison.
        seed: Seed of the random draws.
        label: How messages name the rewrite.
        **capture: :func:`~pattern_infra.capture_torch` options (``before``, ``after``,
            ``dynamic``, ``minimum_deployment_target``).

    Returns:
        The two captured programs and the evidence.

    Raises:
        PatternDefinitionError: The replacement differs from the pattern (the message gives the largest
            difference, the draw and the input values that show it), a function cannot be captured, or
            the reference evaluator has no semantics for one of the ops.
    """
    from ..verification.errors import NotElementwiseError, UnsupportedOpError, VerificationError
    from ..verification.symbolic import ProofStatus, prove_equivalent
    from ..verification.verify import assert_programs_equivalent

    example_inputs = tuple(example_inputs)
    pattern_capture = capture_torch(pattern_fn, example_inputs, **capture)
    names = list(pattern_capture.pattern.functions["main"].inputs)
    replacement = capture_torch(
        replacement_fn, example_inputs, input_names=names, name=f"{label} (replacement)", **capture
    ).pattern
    pattern = pattern_capture.pattern
    rng = np.random.default_rng(seed)
    shapes = [tuple(int(d) for d in getattr(t, "shape", ())) for t in example_inputs]
    dtypes = [_numpy_dtype(t) for t in example_inputs]
    inputs = [
        {name: draw(rng, shape).astype(dtype) for name, shape, dtype in zip(names, shapes, dtypes)}
        for draw in DRAWS.values()
    ]
    draws = tuple(DRAWS)
    try:
        report = assert_programs_equivalent(
            pattern, replacement, inputs=inputs, rtol=rtol, atol=atol, label=f"{label}'s replacement"
        )
    except UnsupportedOpError as exc:
        raise PatternDefinitionError(
            f"{label}: the pair cannot be checked, so it is not registered: {exc} Give the op its semantics "
            f"with pattern_infra.register_op_semantics, or register the pass with register_generic_pass."
        ) from exc
    except VerificationError as exc:
        found = getattr(exc, "report", None)
        if found is None:
            raise PatternDefinitionError(
                f"{label}: the replacement does not compute what the pattern computes: {exc}"
            ) from exc
        worst = found.worst
        shown = _input_at(inputs[worst.trial], worst.index)
        raise PatternDefinitionError(
            f"{label}: the replacement does not compute what the pattern computes. Largest difference "
            f"{worst.max_abs_diff:.6g} (relative {found.max_rel_diff:.3g}) at output {worst.name!r}"
            f"{list(worst.index)} on the {draws[worst.trial]!r} draw, where {shown}: the pattern gives "
            f"{worst.expected:.9g}, the replacement {worst.actual:.9g} (tolerance atol={atol:g} + "
            f"rtol={rtol:g}*|pattern|). Fix the replacement, or state the approximation you mean with "
            f"rtol=."
        ) from exc
    try:
        proof = prove_equivalent(pattern, replacement, rtol=max(rtol, 1e-6), constant_rtol=max(rtol, 1e-6))
    except NotElementwiseError as exc:
        symbolic = f"not elementwise: {exc}"
    else:
        if proof.status is ProofStatus.COUNTEREXAMPLE:
            bad = next(o for o in proof.outputs if o.status is ProofStatus.COUNTEREXAMPLE)
            raise PatternDefinitionError(
                f"{label}: sympy refutes the replacement: output {bad.name!r} is {bad.expr_a} in the "
                f"pattern and {bad.expr_b} in the replacement; at {dict(bad.counterexample or {})} they "
                f"give {bad.value_a!r} and {bad.value_b!r} (difference "
                f"{abs((bad.value_a or 0.0) - (bad.value_b or 0.0)):.6g}). Fix the replacement, or state "
                f"the approximation you mean with rtol=."
            )
        symbolic = proof.status.value
    logger.debug("%s: max |diff| %.3g over %s; sympy: %s", label, report.max_abs_diff, draws, symbolic)
    return RewriteCheck(
        pattern=pattern,
        replacement=replacement,
        point=pattern_capture.point,
        draws=draws,
        max_abs_diff=report.max_abs_diff,
        max_rel_diff=report.max_rel_diff,
        symbolic=symbolic,
    )


def register_torch_rewrite(
    pattern_fn: Callable[..., Any],
    replacement_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    pass_name: str,
    namespace: str,
    *,
    var_constraints: Callable[[Any], Any] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    before: str | None = None,
    after: str | None = None,
    **options: Any,
) -> PassContainer:
    """Registers ``pattern_fn -> replacement_fn`` as a generic pass once the two are shown equivalent.

    Args:
        pattern_fn: The PyTorch function to find (see :func:`~pattern_infra.pattern_from_torch`).
        replacement_fn: The PyTorch function it becomes, with the same positional arguments.
        example_inputs: One example tensor per argument (distinct dimensions larger than 1).
        pass_name: Pass name, e.g. ``"fuse_silu_mine"``.
        namespace: Namespace, e.g. ``"mine"``.
        var_constraints: ``f(pattern)``, as for :func:`~pattern_infra.register_generic_pass`; the check is
            of the pair, not of the constraint.
        rtol: Relative tolerance of the check (see :func:`check_torch_rewrite`).
        atol: Absolute tolerance of the check.
        before: Capture point, as ``pattern_from_torch``'s (default: see the module docstring).
        after: Capture point, as ``pattern_from_torch``'s.
        **options: ``capture_torch``'s ``dynamic`` and ``minimum_deployment_target``; every other option
            goes to ``register_generic_pass`` (``constants``, ``run_after``, ``priority``, ...).

    Returns:
        The container the sub-pass was added to.

    Raises:
        PatternDefinitionError: The replacement differs from the pattern, or a function cannot be
            captured or compiled as a pattern. The registry is left as it was.
        PassRegistrationError: The pass id or an option is unusable (the registry is left as it was).
    """
    capture = {key: options.pop(key) for key in _CAPTURE_OPTIONS if key in options}
    capture.update(_capture_point(pass_name, namespace, before, after, options.get("run_after")))
    label = f"register_torch_rewrite({namespace}::{pass_name})"
    check = check_torch_rewrite(
        pattern_fn, replacement_fn, example_inputs, rtol=rtol, atol=atol, label=label, **capture
    )
    # register_generic_pass is all-or-nothing: a call that raises leaves the registry as it was.
    container = register_generic_pass(
        check.pattern, var_constraints, replace_with(check.replacement), pass_name, namespace, **options
    )
    logger.debug("%s: registered, %s, sympy: %s", label, check.point, check.symbolic)
    return container


def _numpy_dtype(tensor: Any) -> np.dtype:
    try:
        return np.dtype(tensor.numpy().dtype)
    except (AttributeError, TypeError):
        return np.dtype(np.float32)


def _input_at(values: dict[str, np.ndarray], index: tuple[int, ...]) -> str:
    shown = []
    for name, array in values.items():
        if len(index) == array.ndim and all(i < n for i, n in zip(index, array.shape)):
            shown.append(f"{name}{list(index)} = {float(array[index]):.6g}")
        else:
            shown.append(f"{name} = {np.array2string(array, threshold=8, precision=4)}")
    return ", ".join(shown)
