"""Rewrites written as two PyTorch functions (``pattern_infra.pytorch.torch_rewrite``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

import pattern_infra
from pattern_infra import (
    PassRegistrationError,
    PatternDefinitionError,
    check_torch_rewrite,
    evaluate,
    generic_passes,
    register_torch_rewrite,
    verify_pass,
)
from pattern_infra.testing.convert import convert_torch

ROOT = Path(__file__).resolve().parents[1]


def swish(x):
    return x * torch.sigmoid(x)


def _ops(prog):
    return [op.op_type for op in prog.functions["main"].operations if op.op_type != "const"]


def _relu_of_swish(shape=(4, 16)):
    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x):
        return mb.relu(x=mb.mul(x=x, y=mb.sigmoid(x=x)))

    return prog


def _registry_state():
    return (
        dict(PASS_REGISTRY.passes),
        {pid: (list(c.passes), list(c.followers)) for pid, c in generic_passes().items()},
    )


def test_swish_becomes_silu_with_equal_numbers(namespace):
    container = register_torch_rewrite(
        swish, torch.nn.functional.silu, (torch.randn(4, 8),), "silu", namespace
    )
    assert container.pass_id == f"{namespace}::silu"
    prog = _relu_of_swish()
    assert _ops(prog) == ["sigmoid", "mul", "relu"]
    report = verify_pass(container, prog, rtol=1e-6, atol=1e-7)
    assert _ops(report.transformed) == ["silu", "relu"]
    assert report.max_abs_diff < 1e-6
    assert container.stats.rewrites == 1


def test_the_check_proves_silu_with_sympy_and_draws_every_kind_of_input():
    check = check_torch_rewrite(swish, torch.nn.functional.silu, (torch.randn(4, 8),))
    assert check.symbolic == "proven"
    assert check.draws == ("normal", "zeros", "negatives", "large", "tiny")
    assert check.max_abs_diff == 0.0
    assert _ops(check.pattern) == ["sigmoid", "mul"] and _ops(check.replacement) == ["silu"]
    assert list(check.replacement.functions["main"].inputs) == ["x"]


def test_a_replacement_that_differs_is_refused_and_nothing_is_registered(namespace):
    before = _registry_state()
    with pytest.raises(PatternDefinitionError) as info:
        register_torch_rewrite(swish, torch.relu, (torch.randn(4, 8),), "not_silu", namespace)
    message = str(info.value)
    assert f"register_torch_rewrite({namespace}::not_silu)" in message
    assert "Largest difference" in message and "'negatives' draw" in message
    assert "the replacement 0" in message  # relu of a negative input
    assert "x[" in message and "rtol=" in message
    assert _registry_state() == before
    assert f"{namespace}::not_silu" not in PASS_REGISTRY.passes


def test_a_refused_pair_leaves_the_sub_passes_already_under_that_id(namespace):
    container = register_torch_rewrite(
        swish, torch.nn.functional.silu, (torch.randn(4, 8),), "act", namespace
    )
    order = list(container.order)
    with pytest.raises(PatternDefinitionError, match="Largest difference"):
        register_torch_rewrite(torch.tanh, torch.sigmoid, (torch.randn(4, 8),), "act", namespace)
    assert container.order == order
    assert PASS_REGISTRY.passes[f"{namespace}::act"] is container


def test_a_registration_that_fails_after_the_check_leaves_no_trace(namespace):
    before = _registry_state()
    with pytest.raises(PassRegistrationError, match="not a registered pass"):
        register_torch_rewrite(
            swish,
            torch.nn.functional.silu,
            (torch.randn(4, 8),),
            "silu_late",
            namespace,
            run_after="common::no_such_pass",
            before="common::fuse_matmul_weight_bias",
        )
    assert _registry_state() == before


def test_rtol_states_an_approximation_the_user_means(namespace):
    def third(x):
        return x * 0.3333

    def exact(x):
        return x / 3

    with pytest.raises(PatternDefinitionError, match="relative 0.0001"):
        check_torch_rewrite(third, exact, (torch.randn(4, 8),))
    check = check_torch_rewrite(third, exact, (torch.randn(4, 8),), rtol=1e-3)
    assert 1e-5 < check.max_rel_diff < 2e-4
    assert check.symbolic == "proven_up_to_rounding"


def test_a_pair_sympy_cannot_read_is_checked_numerically():
    check = check_torch_rewrite(lambda x: x.sum(-1), lambda x: x.mean(-1) * 8, (torch.randn(4, 8),))
    assert check.symbolic.startswith("not elementwise")
    with pytest.raises(PatternDefinitionError, match="Largest difference"):
        check_torch_rewrite(lambda x: x.sum(-1), lambda x: x.mean(-1) * 7, (torch.randn(4, 8),))


def test_var_constraints_filter_matches_like_any_pass(namespace):
    container = register_torch_rewrite(
        swish,
        torch.nn.functional.silu,
        (torch.randn(4, 8),),
        "silu_rank3",
        namespace,
        var_constraints=lambda p: (len(p.root_var.shape) == 3, "rank 3 only"),
    )
    assert _ops(verify_pass(container, _relu_of_swish((4, 16))).transformed) == ["sigmoid", "mul", "relu"]
    assert _ops(verify_pass(container, _relu_of_swish((2, 4, 16))).transformed) == ["silu", "relu"]


class SwishMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h * torch.sigmoid(h))


def test_inside_a_conversion_with_the_override(namespace):
    register_torch_rewrite(
        swish,
        torch.nn.functional.silu,
        (torch.randn(4, 8),),
        "silu_in_conversion",
        namespace,
        run_after="common::fuse_matmul_weight_bias",
    )
    model, x = SwishMLP().eval(), torch.randn(4, 8)
    pattern_infra.run_log(clear=True)
    prog = convert_torch(model, (x,), override=True)
    log = [(pass_id, stats.rewrites) for pass_id, _, stats in pattern_infra.run_log(clear=True)]
    assert (f"{namespace}::silu_in_conversion", 1) in log  # ours, not the backend's silu fusion
    assert _ops(prog) == ["linear", "silu", "relu"]
    (out,) = evaluate(prog, {"x": x.numpy()}).values()
    np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_on_a_saved_package_through_the_command_line(tmp_path):
    """A module registering a torch rewrite, imported by ``mil-patterns --import`` in a subprocess (the
    test process's registry stays as it was). ``sqrt(x * x)`` is a pattern no other pass fuses, and a
    saved package keeps it (``x * sigmoid(x)`` is fused to silu by coremltools' backend on saving)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 16))])
    def prog(x):
        return mb.relu(x=mb.sqrt(x=mb.mul(x=x, y=x)))

    source = tmp_path / "model.mlpackage"
    ct.convert(
        prog, convert_to="mlprogram", compute_precision=ct.precision.FLOAT32, skip_model_load=True
    ).save(str(source))
    (tmp_path / "my_torch_rewrites.py").write_text(
        textwrap.dedent(
            """
            import torch
            from pattern_infra import register_torch_rewrite

            register_torch_rewrite(
                lambda x: torch.sqrt(x * x), torch.abs, (torch.randn(4, 8),), "sqrt_of_square", "mine_cli"
            )
            """
        )
    )
    out = tmp_path / "fused.mlpackage"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "pattern_infra", "--import", "my_torch_rewrites", "optimize", str(source)]
        + ["-o", str(out), "--passes", "mine_cli::sqrt_of_square"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 rewrite(s); non-const ops 3 -> 2" in result.stdout
    assert "mine_cli::sqrt_of_square" not in PASS_REGISTRY.passes

    from pattern_infra.cli.mlpackage import load_mlpackage

    fused_prog = load_mlpackage(out).program
    assert _ops(fused_prog) == ["abs", "relu"]
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    (want,) = evaluate(prog, {"x": x}).values()
    (got,) = evaluate(fused_prog, {"x": x}).values()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_two_inputs_bind_by_the_pattern_functions_parameter_names(namespace):
    container = register_torch_rewrite(
        lambda a, b: a * b - b,
        lambda a, b: (a - 1) * b,
        (torch.randn(4, 8), torch.randn(4, 8)),
        "factor_out",
        namespace,
    )

    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 16)), mb.TensorSpec(shape=(4, 16))])
    def prog(p, q):
        return mb.relu(x=mb.sub(x=mb.mul(x=p, y=q), y=q))

    report = verify_pass(container, prog, rtol=1e-6, atol=1e-6)
    assert _ops(report.transformed) == ["sub", "mul", "relu"]
    sub = next(op for op in report.transformed.functions["main"].operations if op.op_type == "sub")
    assert sub.x.name == "p" and sub.y.val == 1.0


@pytest.mark.parametrize(
    ("pass_id", "run_after", "point"),
    [
        ("mine::new_fusion", None, {"before": "common::fuse_matmul_weight_bias"}),
        ("mine::new_fusion", "common::fuse_linear_bias", {"after": "common::fuse_linear_bias"}),
        ("common::fuse_gelu_exact", None, {"before": "common::fuse_gelu_exact"}),
        ("mil_backend::fuse_activation_silu", None, {"before": "mil_backend::fuse_activation_silu"}),
    ],
)
def test_the_capture_point_is_where_the_pass_runs(pass_id, run_after, point):
    from pattern_infra.pytorch.torch_rewrite import _capture_point

    namespace, name = pass_id.split("::")
    assert _capture_point(name, namespace, None, None, run_after) == point
    assert _capture_point(name, namespace, None, "frontend", run_after) == {"after": "frontend"}


def test_a_pair_the_evaluator_cannot_run_is_refused(namespace):
    from pattern_infra.verification.evaluator import register_op_semantics, unregister_op_semantics

    semantics = unregister_op_semantics("silu")
    try:
        with pytest.raises(PatternDefinitionError, match="cannot be checked.*register_op_semantics"):
            register_torch_rewrite(
                swish, torch.nn.functional.silu, (torch.randn(4, 8),), "unknown", namespace
            )
    finally:
        register_op_semantics("silu", replace=True)(semantics)
    assert f"{namespace}::unknown" not in PASS_REGISTRY.passes
