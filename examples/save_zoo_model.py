"""Save a zoo model, converted by coremltools without our passes, as an .mlpackage to try `mil-patterns` on.

    .venv/bin/python examples/save_zoo_model.py prenorm_transformer transformer.mlpackage

The names are those of `pattern_infra.testing.models.ZOO` (run without arguments to list them). The model
is exported with torch.export and converted to an ML program (FLOAT32, iOS16) with the override off:
what a user of plain coremltools would have saved.
"""

from __future__ import annotations

import logging
import sys

logging.getLogger("coremltools").setLevel(logging.ERROR)

from pattern_infra.testing.convert import convert_torch_model  # noqa: E402
from pattern_infra.testing.models import ZOO  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ZOO:
        print(
            f"usage: save_zoo_model.py MODEL OUT.mlpackage, MODEL one of: {', '.join(ZOO)}", file=sys.stderr
        )
        return 2
    module, args = ZOO[argv[0]]()
    convert_torch_model(module, args, override=False).save(argv[1])
    print(f"saved {argv[0]} to {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
