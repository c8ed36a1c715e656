"""Models saved at coremltools' default precision (float16), through the command line.

A model saved with ``coremltools.convert``'s default ``compute_precision`` holds float16 constants:
the pattern's ``1/6`` is ``0.1666259765625`` there. ``constants="value"`` compares in the program
constant's dtype, so every pass fuses a float16 model as it fuses the same model in float32. Each test
saves one program (or zoo model) both ways, with coremltools' pipeline from ``add_fp16_cast`` on minus
its fusions (so the patterns are still there to find, as in a model someone saved), and runs
``mil-patterns report --json`` / ``optimize`` on both: the same passes fire, as often.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from coremltools.converters.mil import Builder as mb

from pattern_infra.cli.commands import main
from pattern_infra.cli.mlpackage import load_mlpackage, op_histogram

D = 16

SAVE_PIPELINE = [  # coremltools' default pipeline from add_fp16_cast on, without its fusions
    "common::add_fp16_cast",
    "common::add_int16_cast",
    "common::update_output_dtypes",
    "common::const_elimination",
    "common::dead_code_elimination",
    "common::cast_optimization",
    "common::const_elimination",
    "common::dead_code_elimination",
    "common::const_deduplication",
]

USER_PASSES = """
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types
from pattern_infra import register_generic_pass

@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),))])
def hard_swish(x):                       # x * clip(x + 3, 0, 6) / 6
    a = mb.add(x=x, y=3.0, name="shift")
    c = mb.clip(x=a, alpha=0.0, beta=6.0, name="clip")
    s = mb.mul(x=c, y=1.0 / 6.0, name="scale")
    return mb.mul(x=x, y=s, name="out")

def transform(pattern):
    dtype = types.nptype_from_builtin(pattern.root_var.dtype)  # the constants in the model's precision
    gate = mb.sigmoid_hard(x=pattern.root_var, alpha=dtype(1.0 / 6.0), beta=dtype(0.5), before_op=pattern.out)
    new = mb.mul(x=pattern.root_var, y=gate, name=pattern.out.outputs[0].name, before_op=pattern.out)
    pattern.replace_output(new)

register_generic_pass(hard_swish, None, transform, "fuse_hard_swish", "mine", constants="value")
"""
USER_PASS = "mine::fuse_hard_swish"


def _save(prog_or_exported, path: Path, *, float16: bool) -> Path:
    import coremltools as ct
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline

    precision = ct.precision.FLOAT16 if float16 else ct.precision.FLOAT32
    pipeline = PassPipeline(pass_names=SAVE_PIPELINE, pipeline_name="save_unfused")
    model = ct.convert(
        prog_or_exported,
        convert_to="mlprogram",
        skip_model_load=True,
        compute_precision=precision,
        pass_pipeline=pipeline,
    )
    model.save(str(path))
    return path


def _fired(path: Path) -> Counter[str]:
    """The rewrites of each pass ``mil-patterns report`` finds in the model (the user's pass imported)."""
    result = CliRunner().invoke(
        main, ["--import", "my_fp16_passes", "report", str(path), "--json", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    return Counter(r["pass_id"] for r in json.loads(result.output)["rewrites"])


@pytest.fixture
def user_passes(tmp_path, monkeypatch):
    """The user's module in the current directory, as ``--import`` finds it."""
    (tmp_path / "my_fp16_passes.py").write_text(USER_PASSES)
    monkeypatch.chdir(tmp_path)
    yield
    import sys

    sys.modules.pop("my_fp16_passes", None)
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    PASS_REGISTRY.passes.pop(USER_PASS, None)


def _mix(x):
    """One instance of passes that compare constant values: tanh GELU, erf GELU, quick GELU (fused by
    ``common::fuse_gelu_exact``), a written-out layer norm, the user's hard swish; and of a few others:
    a linear's bias, two ReLUs, a leaky ReLU, a mean written as a sum, a transposed matmul operand."""
    rng = np.random.default_rng(0)
    t = mb.tanh(x=mb.mul(x=mb.add(x=x, y=mb.mul(x=mb.pow(x=x, y=3.0), y=0.044715)), y=0.7978845834732056))
    x = mb.mul(x=mb.mul(x=x, y=0.5), y=mb.add(x=t, y=1.0))
    e = mb.erf(x=mb.mul(x=x, y=0.7071067690849304))
    x = mb.mul(x=mb.mul(x=mb.add(x=e, y=1.0), y=0.5), y=x)
    x = mb.mul(x=x, y=mb.sigmoid(x=mb.mul(x=x, y=1.702)))
    mean = mb.reduce_mean(x=x, axes=[-1], keep_dims=True)
    centred = mb.sub(x=x, y=mean)
    var = mb.reduce_mean(x=mb.mul(x=centred, y=centred), axes=[-1], keep_dims=True)
    x = mb.mul(x=centred, y=mb.rsqrt(x=mb.add(x=var, y=1e-5)))
    x = mb.add(
        x=mb.mul(x=x, y=rng.normal(size=(D,)).astype(np.float32)), y=rng.normal(size=(D,)).astype(np.float32)
    )
    x = mb.linear(x=x, weight=rng.normal(size=(D, D)).astype(np.float32) / 4)
    x = mb.add(x=x, y=rng.normal(size=(D,)).astype(np.float32))  # a bias for the linear
    x = mb.relu(x=mb.relu(x=x))
    x = mb.maximum(x=x, y=mb.mul(x=x, y=0.1))  # leaky ReLU
    x = mb.add(x=x, y=mb.mul(x=mb.reduce_sum(x=x, axes=[-1], keep_dims=True), y=1.0 / D))  # a mean
    x = mb.mul(x=x, y=mb.mul(x=mb.clip(x=mb.add(x=x, y=3.0), alpha=0.0, beta=6.0), y=1.0 / 6.0))
    return mb.matmul(x=x, y=mb.transpose(x=x, perm=[0, 2, 1]))


def _mix_program():
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4, D))])
    def prog(x):
        return _mix(x)

    return prog


def test_a_float16_model_fuses_as_its_float32_twin(tmp_path, user_passes):
    fp32 = _save(_mix_program(), tmp_path / "fp32.mlpackage", float16=False)
    fp16 = _save(_mix_program(), tmp_path / "fp16.mlpackage", float16=True)
    assert "fp16" in str(load_mlpackage(fp16).program)  # saved at the default precision
    expected = _fired(fp32)
    assert expected == Counter(
        {
            "common::fuse_gelu_exact": 2,
            "common::fuse_gelu_tanh_approximation": 1,
            "common::fuse_layernorm_or_instancenorm": 1,
            "common::fuse_linear_bias": 1,
            "common::merge_consecutive_relus": 1,
            "common::fuse_leaky_relu": 1,
            "common::fuse_reduce_mean": 1,
            "common::fuse_transpose_matmul": 1,
            USER_PASS: 1,
        }
    )
    assert _fired(fp16) == expected

    out = tmp_path / "fused.mlpackage"
    result = CliRunner().invoke(
        main, ["--import", "my_fp16_passes", "optimize", str(fp16), "-o", str(out), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{out}: {sum(expected.values())} rewrite(s)")
    counts = op_histogram(load_mlpackage(out).program)
    assert counts["gelu"] == 3 and counts["layer_norm"] == 1 and counts["sigmoid_hard"] == 1
    assert counts["leaky_relu"] == 1 and counts["reduce_mean"] == 1 and counts["relu"] == 1
    assert not {"tanh", "erf", "clip", "sigmoid", "reduce_sum", "transpose"} & set(counts)


def test_the_users_pass_fuses_a_float16_model(tmp_path, user_passes):
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4, D))])
    def prog(x):
        return mb.mul(x=x, y=mb.mul(x=mb.clip(x=mb.add(x=x, y=3.0), alpha=0.0, beta=6.0), y=1.0 / 6.0))

    fp16 = _save(prog, tmp_path / "fp16.mlpackage", float16=True)
    assert _fired(fp16) == Counter({USER_PASS: 1})


ZOO = [
    "prenorm_transformer",
    "gpt2_block",
    "bert_encoder",
    "convnext_stage",
    "clip_mlp",
    "resnet_stack",
    "mobilenet_block",
    "jax_style_gelu_mlp",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_every_generic_pass_fuses_a_float16_zoo_model_as_its_float32_twin(tmp_path, user_passes, name):
    import torch

    from pattern_infra.testing.real_models import builder

    module, args = builder(name)()
    exported = torch.export.export(module.eval(), tuple(args)).run_decompositions({})
    fp32 = _fired(_save(exported, tmp_path / "fp32.mlpackage", float16=False))
    fp16 = _fired(_save(exported, tmp_path / "fp16.mlpackage", float16=True))
    assert fp32  # the model holds patterns the passes fuse
    assert fp16 == fp32
