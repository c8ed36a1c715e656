"""The vision zoo converted with the override off and on, at float32 and float16; and palettized.

:func:`compare_vision` exports a model of :data:`pattern_infra.testing.vision.VISION_ZOO` once and converts
it at iOS18 four times (float32 and float16, override off and on): the op counts (consts excluded), the
generic passes that fired, the error of each program against PyTorch (the reference evaluator, float64
for a float32 program, native precision for a float16 one, against the model run in float64 by PyTorch:
the largest ``|MIL - PyTorch|`` over the largest ``|PyTorch|``; a float32 program's error is then the
rounding of its float32 constants alone) and the repeated op chains the float32 program with the override
still holds (:func:`pattern_infra.suggest`). A program the evaluator cannot run is recorded as
``"not evaluable: <op type>"``, a conversion that raises as ``"conversion failed: ..."``: neither stops the
table.

:func:`compare_palettized` measures issue #35's case: the weights palettized (4-bit, per output channel)
before the fusion passes (``ct.PassPipeline.DEFAULT_PALETTIZATION``), override off and on, against a plain
conversion.

Used by ``examples/vision_models.py`` (``make models``: the tables of docs/MODELS.md) and
``tests/test_vision_models.py``.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..passes.container import run_log
from .convert import convert_exported, op_counts
from .vision import VISION_ZOO

__all__ = [
    "Conversion",
    "PalettizedComparison",
    "VisionComparison",
    "compare_palettized",
    "compare_vision",
    "format_changes",
    "format_palettized_table",
    "format_vision_table",
    "palettizing_pipeline",
]


@dataclass
class Conversion:
    """One conversion of a zoo model."""

    ops: Counter = field(default_factory=Counter)
    """Op-type counts, consts excluded (empty when the conversion failed)."""
    fired: dict[str, int] = field(default_factory=dict)
    """Generic pass id to rewrites (override on only)."""
    error: float | None = None
    """Largest ``|MIL - PyTorch|`` relative to the largest ``|PyTorch|``; None when not measured."""
    problem: str | None = None
    """``"not evaluable: <op>"`` or ``"conversion failed: ..."``; None when all went well."""
    program: Any = None
    """The MIL program (kept only where asked)."""

    @property
    def total(self) -> int:
        """Non-const ops."""
        return sum(self.ops.values())

    def error_text(self) -> str:
        """The error as the tables print it."""
        return self.problem if self.problem else f"{self.error:.1e}"


@dataclass
class VisionComparison:
    """A vision zoo model converted four ways at iOS18."""

    name: str
    """Zoo name."""
    conversions: dict[tuple[str, bool], Conversion]
    """Per ``(precision, override)``: ``("fp32", False)`` ... ``("fp16", True)``."""
    leftovers: list[tuple[tuple[str, ...], int]] = field(default_factory=list)
    """The repeated op chains (op types, occurrences) of the float32 program with the override, best first."""

    def changed(self, precision: str = "fp32") -> dict[str, tuple[int, int]]:
        """Op types whose count the override changed at ``precision``, to ``(off, on)``, sorted by type."""
        off, on = self.conversions[precision, False].ops, self.conversions[precision, True].ops
        return {t: (off[t], on[t]) for t in sorted(set(off) | set(on)) if off[t] != on[t]}


def _relative_error(prog: Any, image: np.ndarray, expected: np.ndarray, precision: str) -> float:
    from ..verification.evaluator import evaluate

    (name,) = prog.functions["main"].inputs
    got = evaluate(prog, {name: image}, precision="native" if precision == "fp16" else "float64")
    (out,) = got.values()
    diff = np.max(np.abs(np.asarray(out, dtype=np.float64) - expected))
    return float(diff / max(float(np.max(np.abs(expected))), 1e-30))


def _unevaluable(prog: Any) -> list[str]:
    """The op types of ``prog`` the reference evaluator has no semantics for (and no value of)."""
    from ..verification.evaluator import supported_op_types
    from .convert import iter_ops

    known = set(supported_op_types())
    return sorted(
        {
            op.op_type
            for op in iter_ops(prog)
            if op.op_type not in known and not all(v.val is not None for v in op.outputs)
        }
    )


def _measure(conversion: Conversion, image: np.ndarray, expected: np.ndarray, precision: str) -> None:
    from ..verification.errors import UnsupportedOpError

    missing = _unevaluable(conversion.program)
    if missing:
        conversion.problem = f"not evaluable: {', '.join(missing)}"
        return
    try:
        conversion.error = _relative_error(conversion.program, image, expected, precision)
    except UnsupportedOpError as e:
        conversion.problem = f"not evaluable: {str(e).split(':')[0]}"


def _convert(exported: Any, override: bool, **kwargs: Any) -> Conversion:
    import coremltools as ct

    run_log(clear=True)
    try:
        prog = convert_exported(
            exported, override=override, minimum_deployment_target=ct.target.iOS18, **kwargs
        )
    except Exception as e:  # a conversion that fails is a row of the table, not the end of it
        return Conversion(problem=f"conversion failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
    fired: dict[str, int] = {}
    for pass_id, _, stats in run_log(clear=True):
        if override and stats.rewrites:
            fired[pass_id] = fired.get(pass_id, 0) + stats.rewrites
    counts = op_counts(prog)
    counts.pop("const", None)
    return Conversion(counts, fired, program=prog)


def _export(name: str) -> tuple[Any, np.ndarray, np.ndarray]:
    import torch

    from ..pytorch import torch_support

    torch_support.install()
    model, (image,) = VISION_ZOO[name]()
    exported = torch.export.export(model, (image,)).run_decompositions({})
    with torch.no_grad():  # the reference: the same weights and image in float64
        expected = copy.deepcopy(model).double()(image.double()).numpy()
    return exported, image.numpy(), expected


def compare_vision(
    name: str,
    *,
    precisions: Sequence[str] = ("fp32", "fp16"),
    numerics: bool = True,
    leftovers: int = 3,
    keep_programs: bool = False,
) -> VisionComparison:
    """Convert vision zoo model ``name`` at iOS18, each precision with the override off and on.

    Args:
        name: A key of :data:`~pattern_infra.testing.vision.VISION_ZOO`.
        precisions: ``"fp32"`` and/or ``"fp16"`` (compute precision of the conversion).
        numerics: Run every program with the reference evaluator against PyTorch.
        leftovers: How many repeated op chains of the fp32 program with the override to keep (0: none).
        keep_programs: Keep each conversion's MIL program in :attr:`Conversion.program`.

    Returns:
        The comparison.
    """
    import coremltools as ct

    compute = {"fp32": ct.precision.FLOAT32, "fp16": ct.precision.FLOAT16}
    exported, image, expected = _export(name)
    conversions = {}
    for precision in precisions:
        for override in (False, True):
            conversion = _convert(exported, override, compute_precision=compute[precision])
            if numerics and conversion.program is not None:
                _measure(conversion, image, expected, precision)
            conversions[precision, override] = conversion
    row = VisionComparison(name, conversions)
    ours = conversions.get(("fp32", True))
    if leftovers and ours is not None and ours.program is not None:
        from .. import suggest

        row.leftovers = [(tuple(c.op_types), c.count) for c in suggest(ours.program)[:leftovers]]
    if not keep_programs:
        for conversion in conversions.values():
            conversion.program = None
    return row


def format_vision_table(rows: list[VisionComparison]) -> str:
    """The Markdown table of docs/MODELS.md's vision zoo: ops, passes fired, errors.

    Args:
        rows: One comparison per model, each with both precisions.

    Returns:
        The table.
    """
    lines = [
        "| model | ops fp32, coremltools / ours | ops fp16, coremltools / ours | generic passes that fired "
        "(rewrites, fp32) | err fp32, off / on | err fp16, off / on |",
        "|---|---:|---:|---|---|---|",
    ]
    for r in rows:
        c = r.conversions
        fired = ", ".join(f"`{k}` ({v})" for k, v in sorted(c["fp32", True].fired.items())) or "none"
        lines.append(
            f"| {r.name} | {c['fp32', False].total} / {c['fp32', True].total} | "
            f"{c['fp16', False].total} / {c['fp16', True].total} | {fired} | "
            f"{c['fp32', False].error_text()} / {c['fp32', True].error_text()} | "
            f"{c['fp16', False].error_text()} / {c['fp16', True].error_text()} |"
        )
    return "\n".join(lines)


def format_changes(rows: list[VisionComparison]) -> str:
    """Per model, the op types the override changed (``type off->on``) at fp32, and at fp16 if different.

    Args:
        rows: The comparisons.

    Returns:
        A Markdown list, one item per model.
    """
    lines = []
    for r in rows:
        parts = []
        for precision in ("fp32", "fp16"):
            changed = r.changed(precision)
            if precision == "fp16" and changed == r.changed("fp32"):
                continue
            detail = ", ".join(f"`{t}` {a}->{b}" for t, (a, b) in changed.items()) or "nothing"
            parts.append(f"{precision}: {detail}")
        lines.append(f"* {r.name}: {'; '.join(parts)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Issue #35: palettized before the fusion passes
# --------------------------------------------------------------------------------------------------------


def palettizing_pipeline() -> Any:
    """coremltools' ``DEFAULT_PALETTIZATION`` pipeline with a 4-bit uniform LUT per output channel for every
    weight of more than 256 elements (``palettize_weights`` runs before the fusion passes)."""
    import coremltools as ct
    from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig

    pipeline = ct.PassPipeline.DEFAULT_PALETTIZATION
    config = OpPalettizerConfig(
        mode="uniform", nbits=4, granularity="per_grouped_channel", group_size=1, weight_threshold=256
    )
    pipeline.set_options("compression::palettize_weights", {"config": OptimizationConfig(config)})
    return pipeline


@dataclass
class PalettizedComparison:
    """A model converted plainly (float32, override off) and palettized before the fusions, off and on."""

    name: str
    """Zoo name."""
    plain: Conversion
    """The plain conversion: default pipeline, no compression, override off."""
    palettized: dict[bool, Conversion]
    """The palettized conversions, by override."""
    difference: float | None = None
    """Largest ``|ours - coremltools'|`` of the palettized programs, relative to the largest output."""

    @staticmethod
    def compute_ops(conversion: Conversion) -> int:
        """Non-const ops other than ``constexpr_*`` (one per compressed weight)."""
        return sum(n for t, n in conversion.ops.items() if not t.startswith("constexpr_"))


def compare_palettized(name: str) -> PalettizedComparison:
    """Convert zoo model ``name`` at iOS18, float32: plainly, and palettized with the override off and on.

    Args:
        name: A key of :data:`~pattern_infra.testing.vision.VISION_ZOO`.

    Returns:
        The comparison; the palettized programs are kept in :attr:`Conversion.program`.
    """
    exported, image, _ = _export(name)
    plain = _convert(exported, False)
    plain.program = None
    palettized = {o: _convert(exported, o, pass_pipeline=palettizing_pipeline()) for o in (False, True)}
    row = PalettizedComparison(name, plain, palettized)
    if all(c.program is not None for c in palettized.values()):
        from ..verification.evaluator import evaluate

        (input_name,) = palettized[False].program.functions["main"].inputs
        off, on = (
            np.asarray(next(iter(evaluate(palettized[o].program, {input_name: image}).values())))
            for o in (False, True)
        )
        row.difference = float(np.max(np.abs(on - off)) / max(float(np.max(np.abs(off))), 1e-30))
    return row


def format_palettized_table(rows: list[PalettizedComparison]) -> str:
    """The Markdown table of docs/MODELS.md's palettized torchvision models.

    Args:
        rows: The comparisons.

    Returns:
        The table.
    """
    lines = [
        "| model | compression | ops: plain / coremltools / ours | compute ops (no `constexpr_*`): plain / "
        "coremltools / ours | batch norms left, coremltools / ours | ours against coremltools |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        off, on = r.palettized[False], r.palettized[True]
        compute = f"{r.compute_ops(r.plain)} / {r.compute_ops(off)} / {r.compute_ops(on)}"
        lines.append(
            f"| {r.name} | 4-bit LUT | {r.plain.total} / {off.total} / {on.total} | {compute} | "
            f"{off.ops['batch_norm']} / {on.ops['batch_norm']} | {r.difference:.1e} |"
        )
    return "\n".join(lines)
