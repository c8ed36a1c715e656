"""How far two programs' outputs lie apart on random inputs (``mil-patterns optimize --verify``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pattern_infra.verification.errors import VerificationError
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.verification.inputs import random_inputs

__all__ = ["largest_difference", "scaled_difference"]


def scaled_difference(expected: Any, actual: Any) -> tuple[float, float]:
    """The largest ``|actual - expected|`` over the output's scale (its largest finite magnitude, at least
    1), and itself; NaN against NaN and an infinity against the same one count as equal."""
    a, b = np.asarray(expected, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    if a.size == 0:
        return 0.0, 0.0
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        gaps = np.where(same, 0.0, np.abs(b - a))
    gap = float(np.nan_to_num(gaps, nan=np.inf).max())
    finite = np.abs(a[np.isfinite(a)])
    scale = max(1.0, float(finite.max()) if finite.size else 1.0)
    return gap / scale, gap


def largest_difference(
    before: Any, after: Any, *, trials: int, sizes: dict[Any, int] | None = None
) -> tuple[float, float, str]:
    """Runs both programs in the reference evaluator on ``trials`` random input sets (seeds 0, 1, ...;
    symbolic dimensions sized by ``sizes``) and returns the largest difference of an output as (difference
    over the output's scale, difference, output name).

    Raises:
        VerificationError: An output's shape differs between the two programs.
        PatternInfraError: The evaluator cannot run one of them.
    """
    worst = (0.0, 0.0, "")
    for seed in range(trials):
        inputs = random_inputs(before, seed=seed, sizes_for_symbols=sizes)
        expected, actual = evaluate(before, inputs), evaluate(after, inputs)
        for (name, a), b in zip(expected.items(), actual.values()):
            if np.shape(a) != np.shape(b):
                raise VerificationError(
                    f"the passes changed the shape of output {name!r} from {np.shape(a)} to {np.shape(b)}"
                )
            worst = max(worst, (*scaled_difference(a, b), name))
    return worst
