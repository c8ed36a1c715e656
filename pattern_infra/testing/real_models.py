"""Convert each zoo model with the override off and on, and compare: ops, passes fired, numerics.

Used by ``make models`` (the table in the README) and by ``tests/test_real_models.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..registry import run_log
from .convert import convert_torch, op_counts
from .models import ZOO

__all__ = ["ModelComparison", "compare_model", "format_table"]


@dataclass
class ModelComparison:
    """One zoo model converted both ways."""

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

    @property
    def total_off(self) -> int:
        """Non-const ops, override off."""
        return sum(self.ops_off.values())

    @property
    def total_on(self) -> int:
        """Non-const ops, override on."""
        return sum(self.ops_on.values())


def _counts(prog) -> Counter:
    counts = op_counts(prog)
    counts.pop("const", None)
    return counts


def compare_model(name: str, *, numerics: bool = True) -> ModelComparison:
    """Converts zoo model ``name`` with the override off and on.

    Args:
        name: A key of :data:`pattern_infra.testing.models.ZOO`.
        numerics: Also run both programs with the reference evaluator and compare with PyTorch.

    Returns:
        The comparison.
    """
    import torch

    from ..evaluator import evaluate

    model, args = ZOO[name]()
    programs = {}
    fired: dict[str, int] = {}
    for override in (False, True):
        run_log(clear=True)
        programs[override] = convert_torch(model, args, override=override)
        if override:
            for pass_id, _, stats in run_log(clear=True):
                if stats.rewrites:
                    fired[pass_id] = fired.get(pass_id, 0) + stats.rewrites
    result = ModelComparison(name, _counts(programs[False]), _counts(programs[True]), fired)
    if numerics:
        with torch.no_grad():
            expected = model(*args)
        expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
        expected_np = [e.detach().numpy().astype(np.float64) for e in expected]
        result.scale = max(float(np.max(np.abs(e))) for e in expected_np)
        for override, prog in programs.items():
            names = list(prog.functions["main"].inputs)
            feed = {n: a.detach().numpy() for n, a in zip(names, args)}
            got = list(evaluate(prog, feed).values())
            err = max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected_np))
            if override:
                result.max_abs_err_on = err
            else:
                result.max_abs_err_off = err
    return result


def format_table(rows: list[ModelComparison]) -> str:
    """A Markdown table: model, ops without and with the override, passes that fired, errors."""
    lines = [
        "| model | ops, coremltools | ops, + generic passes | generic passes that fired (rewrites) | max abs err off / on |",
        "|---|---:|---:|---|---|",
    ]
    for r in rows:
        fired = ", ".join(f"`{k}` ({v})" for k, v in sorted(r.fired.items())) or "none"
        lines.append(
            f"| {r.name} | {r.total_off} | {r.total_on} | {fired} | "
            f"{r.max_abs_err_off:.1e} / {r.max_abs_err_on:.1e} |"
        )
    return "\n".join(lines)
