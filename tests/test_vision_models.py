"""The vision zoo (torchvision and timm, random weights) converted at iOS18 with the override off and on.

Every model, at float32 and float16: never more ops with the override; every program evaluable by the
reference evaluator; a float32 program with the override no further from PyTorch than coremltools' (both
evaluated in float64 against the model run by PyTorch in float64) and within 1e-4 of it relative to the
output scale (the rounding of folded float32 constants: 2e-14 where nothing is folded, 2e-5 at most in
the zoo, without the override too); a float16 program no further from PyTorch with the override than
without, beyond float16's own rounding (2**-10 of the output scale). The models of
:data:`~pattern_infra.testing.vision.FAST` run in ``make test``, the others under ``make models``
(``--run-slow``), with ResNet-18 and MobileNetV2 palettized before the fusion passes (issue #35).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pattern_infra.testing.vision import FAST, VISION_ZOO, calibrate_batch_norms, randomize_constants
from pattern_infra.testing.vision_compare import VisionComparison, compare_palettized, compare_vision

REL_TOL = 1e-4
FP16_ROUNDING = 2.0**-10


@functools.cache
def _compared(name: str) -> VisionComparison:
    return compare_vision(name, leftovers=0)


def _params() -> list:
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in VISION_ZOO]


@pytest.mark.parametrize("name", _params())
def test_never_more_ops_and_outputs_equal_to_pytorch(name):
    row = _compared(name)
    for (precision, override), conversion in row.conversions.items():
        assert conversion.problem is None, (precision, override, conversion.problem)
    for precision in ("fp32", "fp16"):
        off, on = row.conversions[precision, False], row.conversions[precision, True]
        assert on.total <= off.total, (precision, row.changed(precision))
        if precision == "fp32":
            assert on.error <= off.error * (1 + 1e-3) + 1e-9, (off.error, on.error)
            assert on.error < REL_TOL, on.error
        else:
            assert on.error <= off.error + FP16_ROUNDING, (off.error, on.error)


def test_randomize_constants_leaves_no_constant_tensor_and_keeps_variances_positive():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.GroupNorm(2, 8), torch.nn.Flatten()
    )
    scale = torch.nn.Parameter(torch.full((8,), 1e-6))
    model.register_parameter("layer_scale", scale)
    randomize_constants(model)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            assert not bool((tensor == tensor.flatten()[0]).all()), name
    assert bool((model[1].running_var > 0).all())
    assert float(scale.abs().min()) > 0.1  # a 1e-6 layer scale becomes one that matters


def test_calibrated_batch_norms_normalise_their_inputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8, affine=False)).eval()
    with torch.no_grad():
        model[0].weight.mul_(10.0)
        model[0].bias.add_(5.0)
    calibrate_batch_norms(model, size=16)
    assert not model.training and model[1].momentum == 0.1
    with torch.no_grad():
        out = model(torch.randn(8, 3, 16, 16))
    assert float(out.mean().abs()) < 0.1 and abs(float(out.std()) - 1.0) < 0.1


def test_transformers_imports_beside_torchvision():
    """torchvision is installed (the test extra), so ``transformers`` imports it: through
    ``hf_models`` (the shim first) a model class loads."""
    code = (
        "from pattern_infra.testing import hf_models\n"
        "transformers = hf_models._transformers()\n"
        "import torchvision\n"
        "print(transformers.LlamaForCausalLM.__name__, type(torchvision.models.resnet18()).__name__)"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["LlamaForCausalLM", "ResNet"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2"])
def test_palettized_before_the_fusions_keeps_no_batch_norm_a_plain_conversion_fuses(name):
    """Issue #35: weights palettized before the fusion passes. coremltools keeps the batch norms; with the
    override every one a plain conversion fuses is folded into the compressed weight, leaving the plain
    conversion's compute ops plus one ``constexpr_*`` op per weight; outputs as coremltools' palettized
    program computes them, up to one more float32 rounding of the folded LUT entries."""
    row = compare_palettized(name)
    off, on = row.palettized[False], row.palettized[True]
    assert off.problem is None and on.problem is None, (off.problem, on.problem)
    assert off.ops["batch_norm"] > row.plain.ops["batch_norm"]
    assert on.ops["batch_norm"] <= row.plain.ops["batch_norm"]
    assert row.compute_ops(on) <= row.compute_ops(row.plain) < row.compute_ops(off)
    assert row.difference is not None and row.difference < 1e-4
