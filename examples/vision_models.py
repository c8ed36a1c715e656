"""`make models`: the vision zoo converted with and without our passes; prints docs/MODELS.md's vision tables.

Every model of ``pattern_infra.testing.vision.VISION_ZOO`` (torchvision and timm, random weights) at iOS18,
float32 and float16, override off and on: ops, passes fired, errors against PyTorch; then the op types the
override changed, the repeated op chains left (``pattern_infra.suggest``), and ResNet-18 and MobileNetV2
palettized before the fusion passes (issue #35). With zoo names as arguments, only those models (and no
palettized rows): ``python examples/vision_models.py resnet18 swin_t``.
"""

from __future__ import annotations

import sys

from pattern_infra.testing.vision import VISION_ZOO
from pattern_infra.testing.vision_compare import (
    compare_palettized,
    compare_vision,
    format_changes,
    format_palettized_table,
    format_vision_table,
)


def main(names: list[str]) -> None:
    rows = []
    for name in names or VISION_ZOO:
        rows.append(compare_vision(name))
        print(format_vision_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_vision_table(rows))
    print()
    print(format_changes(rows))
    print()
    for row in rows:
        chains = "; ".join(f"{' -> '.join(types)} (x{count})" for types, count in row.leftovers) or "none"
        print(f"* {row.name}: {chains}")
    if not names:
        print()
        print(format_palettized_table([compare_palettized(n) for n in ("resnet18", "mobilenet_v2")]))


if __name__ == "__main__":
    main(sys.argv[1:])
