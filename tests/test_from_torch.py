"""Patterns written as PyTorch code (``pattern_infra.pytorch.from_torch``)."""

from __future__ import annotations

import copy
import subprocess
import sys

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb

from pattern_infra import PatternDefinitionError, compile_pattern, find_matches, register_generic_pass
from pattern_infra.pytorch.from_torch import (
    DEFAULT_BEFORE,
    _as_pattern,
    capture_passes,
    capture_torch,
    pattern_from_torch,
)
from pattern_infra.testing.convert import convert_torch
from pattern_infra.testing.passes import op_types
from pattern_infra.verification.verify import assert_programs_equivalent


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def rms_norm(x, weight):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight


class QuickGeluMLP(torch.nn.Module):
    def __init__(self, scale: float = 1.702) -> None:
        super().__init__()
        self.fc1, self.fc2, self.scale = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), scale

    def forward(self, x):
        h = self.fc1(x)
        h = h * torch.sigmoid(self.scale * h)
        h = self.fc2(h)
        return h * torch.sigmoid(self.scale * h)


def _pattern_ops(prog):
    return [(op.name, op.op_type) for op in prog.functions["main"].operations if op.op_type != "const"]


def _main_before_pass(module, args, pass_id=DEFAULT_BEFORE):
    names = list(ct.PassPipeline.DEFAULT.passes)
    pipeline = ct.PassPipeline(names[: names.index(pass_id)], "test_prefix")
    return convert_torch(module, args, override=False, pass_pipeline=pipeline)


def test_ops_are_named_by_type_and_index_and_inputs_after_the_parameters():
    capture = capture_torch(quick_gelu, (torch.randn(2, 3),))
    assert _pattern_ops(capture.pattern) == [("mul_0", "mul"), ("sigmoid_0", "sigmoid"), ("mul_1", "mul")]
    main = capture.pattern.functions["main"]
    assert list(main.inputs) == ["x"]
    assert capture.dynamic and all(not isinstance(d, int) for d in main.inputs["x"].shape)
    assert set(capture.names) == {"mul_0", "sigmoid_0", "mul_1"}
    assert capture.point == f"before {DEFAULT_BEFORE}"
    assert "common::divide_to_multiply" in capture.passes and DEFAULT_BEFORE not in capture.passes
    const = main.find_ops(op_type="const")
    assert [c.name for c in const] == ["mul_0_y"] and np.isclose(const[0].val.val, 1.702)


def test_capturing_a_pattern_prints_no_progress_bars(capfd):
    pattern_from_torch(quick_gelu, (torch.randn(2, 8),))
    err = capfd.readouterr().err
    assert "Running MIL" not in err and "Converting PyTorch Frontend" not in err, err


def test_capture_is_deterministic():
    first = pattern_from_torch(rms_norm, (torch.randn(2, 3, 8), torch.randn(8)))
    second = pattern_from_torch(rms_norm, (torch.randn(4, 5, 6), torch.randn(6)))
    assert _pattern_ops(first) == _pattern_ops(second)
    assert _pattern_ops(first) == [
        ("mul_0", "mul"),
        ("reduce_mean_0", "reduce_mean"),
        ("add_0", "add"),
        ("rsqrt_0", "rsqrt"),
        ("mul_1", "mul"),
        ("mul_2", "mul"),
    ]
    assert list(first.functions["main"].inputs) == ["x", "weight"]


def test_captured_pattern_finds_the_torch_code_in_a_converted_model(namespace):
    gelu = pattern_from_torch(quick_gelu, (torch.randn(2, 3),))
    torch.manual_seed(0)
    prog = _main_before_pass(QuickGeluMLP(), (torch.randn(4, 8),))
    assert len(list(find_matches(gelu, prog, constants="value"))) == 2
    other = _main_before_pass(QuickGeluMLP(scale=1.5), (torch.randn(4, 8),))
    assert len(list(find_matches(gelu, other))) == 2  # constants="any": any scale
    assert list(find_matches(gelu, other, constants="value")) == []

    def to_gelu(pattern):
        out = mb.gelu(
            x=pattern.root_var,
            mode="SIGMOID_APPROXIMATION",
            name=pattern.mul_1.outputs[0].name,
            before_op=pattern.mul_1,
        )
        pattern.replace_output(out)

    container = register_generic_pass(gelu, None, to_gelu, "quick_gelu", namespace, constants="value")
    after = copy.deepcopy(prog)
    container(after)
    assert op_types(after).count("gelu") == 2 and "sigmoid" not in op_types(after)
    assert_programs_equivalent(prog, after, rtol=1e-5, atol=1e-6)


def test_capture_point_decides_what_the_pattern_is():
    def halve(x):
        return torch.relu(x) / 2.0

    raw = op_types(pattern_from_torch(halve, (torch.randn(3, 4),), after="frontend"))
    assert raw[0] == "relu" and raw[-1] == "real_div" and "mul" not in raw  # with the frontend's casts
    assert op_types(pattern_from_torch(halve, (torch.randn(3, 4),))) == ["relu", "mul"]
    frontend = capture_torch(halve, (torch.randn(3, 4),), after="frontend")
    assert "common::divide_to_multiply" not in frontend.passes

    def silu(x):
        return x * torch.sigmoid(x)

    before = pattern_from_torch(silu, (torch.randn(3, 4),), before="mil_backend::fuse_activation_silu")
    after = pattern_from_torch(silu, (torch.randn(3, 4),), after="mil_backend::fuse_activation_silu")
    assert op_types(before) == ["sigmoid", "mul"] and op_types(after) == ["silu"]


def test_capture_points_of_the_pipeline():
    names = list(ct.PassPipeline.DEFAULT.passes)
    default, backend, _ = capture_passes(before="common::fuse_gelu_exact")
    assert default == names[: names.index("common::fuse_gelu_exact")] and backend == []
    default, _, point = capture_passes(after="common::fuse_linear_bias")
    assert default[-1] == "common::fuse_linear_bias" and point == "after common::fuse_linear_bias"
    assert capture_passes(after="frontend")[:2] == ([], [])


def test_a_follower_pass_is_captured_after_its_leader(namespace):
    @mb.program(input_specs=[mb.TensorSpec(shape=(2,))])
    def relu_relu(x):
        return mb.relu(x=mb.relu(x=x, name="a"), name="b")

    register_generic_pass(
        relu_relu, None, lambda p: False, "follower", namespace, run_after="common::fuse_linear_bias"
    )
    default, _, point = capture_passes(before=f"{namespace}::follower")
    assert default[-1] == "common::fuse_linear_bias" and "right after common::fuse_linear_bias" in point


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"before": "common::nope"}, "not a pass of coremltools"),
        ({"before": DEFAULT_BEFORE, "after": DEFAULT_BEFORE}, "either before= or after="),
    ],
)
def test_bad_capture_points_are_refused(kwargs, message):
    with pytest.raises(PatternDefinitionError, match=message):
        capture_passes(**kwargs)


def test_control_flow_is_refused():
    # coremltools' torch.export frontend cannot convert torch.cond yet; a converted program with a cond
    # (as the TorchScript frontend makes) is read by the same function.
    @mb.program(input_specs=[mb.TensorSpec(shape=(3,))])
    def branchy(x):
        return mb.cond(
            pred=mb.greater(x=mb.reduce_sum(x=x), y=0.0),
            _true_fn=lambda: mb.relu(x=x),
            _false_fn=lambda: mb.sigmoid(x=x),
        )

    with pytest.raises(PatternDefinitionError, match="nested blocks"):
        _as_pattern(branchy, ["x"], "branchy", dynamic=True)


def test_module_parameters_become_constants_and_the_pattern_compiles():
    capture = capture_torch(torch.nn.LayerNorm(8), (torch.randn(2, 3, 8),), after="frontend")
    assert op_types(capture.pattern) == ["layer_norm"]
    compiled = compile_pattern(capture.pattern, constants="const")
    assert compiled.root_names == ["input"] and {k for k, _, _ in compiled.consts} >= {
        "layer_norm_0.gamma",
        "layer_norm_0.beta",
    }


def test_importing_pattern_infra_never_needs_torch():
    code = (
        "import sys; sys.modules['torch'] = None; import pattern_infra, pattern_infra.pytorch.from_torch; "
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
