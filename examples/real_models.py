"""`make models`: every zoo model converted with and without our passes; prints the tables of docs/MODELS.md.

First the hand-written zoo (``pattern_infra.testing.models``, iOS16), then the ``transformers`` zoo
(``pattern_infra.testing.hf_models``) at iOS17 and iOS18 (the models of ``BOTH_PRECISIONS`` at fp32 and
fp16, the others at fp32), each followed by the op types whose count the override changed. With zoo names
as arguments, only those ``transformers`` models: ``python examples/real_models.py swin t5_eager``.
"""

from __future__ import annotations

import sys

import coremltools as ct

from pattern_infra.testing.hf_models import BOTH_PRECISIONS, HF_ZOO
from pattern_infra.testing.models import ZOO
from pattern_infra.testing.real_models import (
    PRECISIONS,
    ModelComparison,
    compare_model,
    compare_targets,
    format_table,
)


def _changes(rows: list[ModelComparison]) -> None:
    for row in rows:
        changed = row.changed()
        if changed:
            detail = ", ".join(f"{t} {a}->{b}" for t, (a, b) in changed.items())
            print(f"{row.name} ({getattr(row.target, 'name', row.target)}, {row.precision}): {detail}")


def main(names: list[str]) -> None:
    if not names:
        rows = [compare_model(name) for name in ZOO]
        print(format_table(rows))
        _changes(rows)
        print()
    hf_rows = []
    for name in names or HF_ZOO:
        precisions = PRECISIONS if name in BOTH_PRECISIONS else ("fp32",)
        hf_rows += compare_targets(name, [ct.target.iOS17, ct.target.iOS18], precisions=precisions)
    print(format_table(hf_rows, with_target=True))
    _changes(hf_rows)


if __name__ == "__main__":
    main(sys.argv[1:])
