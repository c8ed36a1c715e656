"""Convert each zoo model with the override off and on, and compare: ops, passes fired, numerics.

Two zoos: :data:`pattern_infra.testing.models.ZOO` (modules written the way model libraries write them)
and :data:`pattern_infra.testing.hf_models.HF_ZOO` (the ``transformers`` classes themselves, tiny random
configs). Each model is exported once and converted for every requested deployment target, override off
and on. Used by ``make models`` (the tables of docs/MODELS.md) and by ``tests/test_real_models.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..passes.container import run_log
from .convert import DEFAULT_TARGET, convert_exported, op_counts
from .models import ZOO, ModelAndArgs

__all__ = ["PRECISIONS", "ModelComparison", "builder", "compare_model", "compare_targets", "format_table"]


@dataclass
class ModelComparison:
    """One zoo model converted both ways for one deployment target."""

    name: str
    """Zoo name."""
    ops_off: Counter
    """Op-type counts (consts excluded) with coremltools' passes."""
    ops_on: Counter
    """Op-type counts (consts excluded) with ENABLE_EXPERIMENTAL_PASSES=1."""
    fired: dict[str, int] = field(default_factory=dict)
    """Generic pass id to rewrites, for the conversion with the override on."""
    max_abs_err_off: float = 0.0
    """Largest |MIL - PyTorch| over the outputs, override off (reference evaluator, float64)."""
    max_abs_err_on: float = 0.0
    """Same, override on."""
    scale: float = 1.0
    """Largest |PyTorch output|, to read the errors relatively."""
    target: Any = DEFAULT_TARGET
    """The ``minimum_deployment_target`` of both conversions."""
    precision: str = "fp32"
    """The ``compute_precision`` of both conversions, ``"fp32"`` or ``"fp16"``. The errors of an fp16
    program are measured with the reference evaluator in native precision (every op rounded to fp16, as
    the program computes), those of an fp32 program in float64."""

    @property
    def total_off(self) -> int:
        """Non-const ops, override off."""
        return sum(self.ops_off.values())

    @property
    def total_on(self) -> int:
        """Non-const ops, override on."""
        return sum(self.ops_on.values())

    @property
    def rel_err_off(self) -> float:
        """:attr:`max_abs_err_off` relative to the output scale."""
        return self.max_abs_err_off / max(self.scale, 1e-30)

    @property
    def rel_err_on(self) -> float:
        """:attr:`max_abs_err_on` relative to the output scale."""
        return self.max_abs_err_on / max(self.scale, 1e-30)

    def changed(self) -> dict[str, tuple[int, int]]:
        """Op types whose count differs, to ``(off, on)`` counts, sorted by type."""
        types = sorted(set(self.ops_off) | set(self.ops_on))
        return {t: (self.ops_off[t], self.ops_on[t]) for t in types if self.ops_off[t] != self.ops_on[t]}


def _counts(prog) -> Counter:
    counts = op_counts(prog)
    counts.pop("const", None)
    return counts


def builder(name: str) -> Callable[[], ModelAndArgs]:
    """The builder of zoo model ``name``, from either zoo.

    Args:
        name: A key of :data:`~pattern_infra.testing.models.ZOO` or of
            :data:`~pattern_infra.testing.hf_models.HF_ZOO`.

    Returns:
        The builder, callable with no argument.

    Raises:
        KeyError: ``name`` is in neither zoo.
    """
    if name in ZOO:
        return ZOO[name]
    from .hf_models import HF_ZOO

    return HF_ZOO[name]


PRECISIONS = ("fp32", "fp16")
"""The compute precisions :func:`compare_targets` knows, by their names in the tables."""


def compare_targets(
    name: str, targets: Sequence[Any], *, numerics: bool = True, precisions: Sequence[str] = ("fp32",)
) -> list[ModelComparison]:
    """Exports zoo model ``name`` once and converts it for each target and precision with the override off
    and on.

    The converters of :mod:`pattern_infra.pytorch.torch_support` are installed first: the ``transformers``
    models' graphs need them.

    Args:
        name: A zoo name (see :func:`builder`).
        targets: ``coremltools.target`` values.
        numerics: Also run every program with the reference evaluator and compare with PyTorch.
        precisions: Names from :data:`PRECISIONS`: each target is converted at each of them.

    Returns:
        One comparison per target and precision, targets outer, in the order given.

    Raises:
        ValueError: A precision is not one of :data:`PRECISIONS`.
    """
    import coremltools as ct
    import torch

    from ..pytorch import torch_support

    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise ValueError(
            f"compare_targets({name!r}): unknown precisions {unknown}; use some of {list(PRECISIONS)}."
        )
    compute = {"fp32": ct.precision.FLOAT32, "fp16": ct.precision.FLOAT16}
    torch_support.install()
    model, args = builder(name)()
    exported = torch.export.export(model.eval(), tuple(args)).run_decompositions({})
    expected_np: list[np.ndarray] = []
    if numerics:
        with torch.no_grad():
            expected = model(*args)
        expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
        expected_np = [e.detach().numpy().astype(np.float64) for e in expected]
    rows = []
    for target in targets:
        for precision in precisions:
            programs = {}
            fired: dict[str, int] = {}
            for override in (False, True):
                run_log(clear=True)
                programs[override] = convert_exported(
                    exported,
                    override=override,
                    minimum_deployment_target=target,
                    compute_precision=compute[precision],
                )
                if override:
                    for pass_id, _, stats in run_log(clear=True):
                        if stats.rewrites:
                            fired[pass_id] = fired.get(pass_id, 0) + stats.rewrites
            row = ModelComparison(
                name,
                _counts(programs[False]),
                _counts(programs[True]),
                fired,
                target=target,
                precision=precision,
            )
            if numerics:
                row.scale = max(float(np.max(np.abs(e))) for e in expected_np)
                row.max_abs_err_off, row.max_abs_err_on = (
                    _max_abs_err(programs[override], args, expected_np, precision)
                    for override in (False, True)
                )
            rows.append(row)
    return rows


def _max_abs_err(prog: Any, args: Sequence[Any], expected: list[np.ndarray], precision: str) -> float:
    """Largest |program - PyTorch| over the outputs, the program run in float64 (fp32) or natively (fp16)."""
    from ..verification.evaluator import evaluate

    feed = {n: a.detach().numpy() for n, a in zip(prog.functions["main"].inputs, args)}
    got = evaluate(prog, feed, precision="native" if precision == "fp16" else "float64").values()
    return max(float(np.max(np.abs(np.asarray(g, dtype=np.float64) - e))) for g, e in zip(got, expected))


def compare_model(name: str, *, target: Any = None, numerics: bool = True) -> ModelComparison:
    """Converts zoo model ``name`` with the override off and on for one target.

    Args:
        name: A zoo name (see :func:`builder`).
        target: The ``minimum_deployment_target``; :data:`~pattern_infra.testing.convert.DEFAULT_TARGET`
            when None.
        numerics: Also run both programs with the reference evaluator and compare with PyTorch.

    Returns:
        The comparison.
    """
    return compare_targets(name, [DEFAULT_TARGET if target is None else target], numerics=numerics)[0]


def format_table(rows: list[ModelComparison], *, with_target: bool = False) -> str:
    """A Markdown table: model, ops without and with the override, reduction, passes that fired, errors.

    Args:
        rows: The comparisons, one per line.
        with_target: Add a column naming each row's deployment target, and give the errors relative to
            the output scale instead of absolute.

    Returns:
        The table.
    """
    if not with_target:
        lines = [
            "| model | ops, coremltools | ops, + generic passes | generic passes that fired (rewrites) "
            "| max abs err off / on |",
            "|---|---:|---:|---|---|",
        ]
    else:
        lines = [
            "| model | target | precision | ops, coremltools | ops, + generic passes | reduction "
            "| generic passes that fired (rewrites) | max err / output scale, off / on |",
            "|---|---|---|---:|---:|---:|---|---|",
        ]
    for r in rows:
        fired = ", ".join(f"`{k}` ({v})" for k, v in sorted(r.fired.items())) or "none"
        if not with_target:
            lines.append(
                f"| {r.name} | {r.total_off} | {r.total_on} | {fired} | "
                f"{r.max_abs_err_off:.1e} / {r.max_abs_err_on:.1e} |"
            )
            continue
        reduction = 1.0 - r.total_on / r.total_off if r.total_off else 0.0
        lines.append(
            f"| {r.name} | {getattr(r.target, 'name', r.target)} | {r.precision} | {r.total_off} | "
            f"{r.total_on} | {100 * reduction:.1f}% | {fired} | {r.rel_err_off:.1e} / {r.rel_err_on:.1e} |"
        )
    return "\n".join(lines)
