"""Patterns written as PyTorch code: ``pattern_from_torch(fn, example_inputs)``.

The pass author writes the PyTorch he knows; the framework exports it with ``torch.export``, runs
coremltools' own frontend and the part of the default pipeline that runs before the capture point
(here the default one, the pipeline's first fusion pass) and reads the MIL it really becomes into a
pattern program, ops named ``<op type>_<k>``::

    lambda x: x * torch.sigmoid(1.702 * x)
    becomes   x --> mul(y=1.702) "mul_0" --> sigmoid "sigmoid_0" --> mul(x, .) "mul_1"

The pattern is registered as any ``mb.program`` pattern; ``constants="value"`` makes the captured 1.702
a value the program must hold. Shown: the captured pattern, the passes that ran before the capture, a
small MLP converted up to the same point and rewritten, numerical equality, and a second capture point:
``x / 2`` is ``real_div`` right after the frontend but ``mul(x, 0.5)`` where fusions run.
"""

import _common as ex
import coremltools as ct
import torch
from coremltools.converters.mil import Builder as mb

from pattern_infra import find_matches, register_generic_pass
from pattern_infra.pytorch.from_torch import DEFAULT_BEFORE, capture_torch, pattern_from_torch
from pattern_infra.testing.convert import convert_torch

ex.banner("1. the PyTorch code, as coremltools converts it")
capture = capture_torch(lambda x: x * torch.sigmoid(1.702 * x), (torch.randn(2, 8),), name="quick_gelu")
ex.show(capture.pattern, f"pattern captured {capture.point}")
print(f"passes that ran before the capture: {len(capture.passes)}, the last three {capture.passes[-3:]}")
print(f"pattern op -> coremltools' name: {capture.names}")
ex.check(ex.op_types(capture.pattern) == ["mul", "sigmoid", "mul"], "three ops, named by type and index")


def to_gelu(pattern):
    out = mb.gelu(
        x=pattern.root_var,
        mode="SIGMOID_APPROXIMATION",
        name=pattern.mul_1.outputs[0].name,
        before_op=pattern.mul_1,
    )
    pattern.replace_output(out)


quick_gelu = register_generic_pass(
    capture.pattern, None, to_gelu, "fuse_quick_gelu_from_torch", "examples", constants="value"
)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


ex.banner("2. the pattern finds the same code in a converted model, and rewrites it")
torch.manual_seed(0)
names = list(ct.PassPipeline.DEFAULT.passes)
pipeline = ct.PassPipeline(names[: names.index(DEFAULT_BEFORE)], "up_to_the_capture")
model = convert_torch(MLP(), (torch.randn(4, 8),), override=False, pass_pipeline=pipeline)
ex.check(len(list(find_matches(capture.pattern, model, constants="value"))) == 1, "one match in the MLP")
after = ex.rewrite(quick_gelu, model)
ex.check(ex.op_types(after) == ["linear", "gelu", "linear"], "linear, gelu, linear")
ex.compare(model, after)

ex.banner("3. the capture point decides what the pattern is")
halve = lambda x: torch.relu(x) / 2.0  # noqa: E731
ex.show(pattern_from_torch(halve, (torch.randn(3, 4),), after="frontend"), "right after the frontend")
where_fusions_run = pattern_from_torch(halve, (torch.randn(3, 4),))
ex.show(where_fusions_run, f"before {DEFAULT_BEFORE} (divide_to_multiply ran)")
ex.check(ex.op_types(where_fusions_run) == ["relu", "mul"], "x / 2 became x * 0.5 before the fusions")
