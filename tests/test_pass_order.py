"""The order of generic passes that compete for the same ops (docs/PASSES.md, "Pass order").

LeViT's attention is ``softmax(q @ k * scale + bias) @ v`` with a per-head positional bias ``[H, N, N]``.
Where the resolution is 1 (its last stage on a small image: N = 1) the bias is ``[H, 1, 1]``, a
per-channel constant of the rank-4 scores, so the ``mul`` + ``add`` is also what
``common::fuse_elementwise_to_batchnorm`` turns into a ``batch_norm``. Run first, it took those two ops
and the attention was never fused; ``generic::fuse_sdpa``, which saves more ops, now runs before it.
"""

from __future__ import annotations

import math

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program
from torch import nn

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import run_log
from pattern_infra.testing.convert import convert_torch, count_ops, op_counts
from pattern_infra.testing.passes import op_types, run_pass
from pattern_infra.verification.evaluator import evaluate

SDPA = "scaled_dot_product_attention"
SDPA_PASS = "generic::fuse_sdpa"
BN_PASS = "common::fuse_elementwise_to_batchnorm"


class LinearNorm(nn.Module):
    """LeViT's ``Linear`` without bias, then a ``BatchNorm1d`` over the flattened tokens."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.bn = nn.BatchNorm1d(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class LeViTAttention(nn.Module):
    """timm's ``levit.Attention`` (``use_conv=False``): the bias is gathered from ``[H, N]`` parameters."""

    def __init__(self, dim: int, key_dim: int, heads: int, attn_ratio: int, resolution: int) -> None:
        super().__init__()
        self.heads, self.key_dim, self.val_dim = heads, key_dim, attn_ratio * key_dim
        self.scale = key_dim**-0.5
        self.qkv = LinearNorm(dim, heads * (2 * key_dim + self.val_dim))
        self.proj = nn.Sequential(nn.Hardswish(), LinearNorm(heads * self.val_dim, dim))
        points = torch.stack(
            torch.meshgrid(torch.arange(resolution), torch.arange(resolution), indexing="ij")
        ).flatten(1)
        offsets = (points[:, :, None] - points[:, None, :]).abs()
        self.register_buffer("bias_idxs", offsets[0] * resolution + offsets[1], persistent=False)
        self.attention_biases = nn.Parameter(torch.randn(heads, resolution * resolution))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (
            self.qkv(x).view(b, n, self.heads, -1).split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        )
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        attn = q @ k * self.scale + self.attention_biases[:, self.bias_idxs]
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, self.heads * self.val_dim)
        return self.proj(x)


class LeViTStyle(nn.Module):
    """Two residual attention blocks at resolution 2 (N = 4), pooled, then two at resolution 1 (N = 1)."""

    def __init__(self, dim: int = 32, key_dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.stage_2 = nn.ModuleList(LeViTAttention(dim, key_dim, heads, 2, 2) for _ in range(2))
        self.stage_1 = nn.ModuleList(LeViTAttention(dim, key_dim, heads, 2, 1) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.stage_2:
            x = x + block(x)
        x = x.mean(1, keepdim=True)
        for block in self.stage_1:
            x = x + block(x)
        return x


def _levit_style() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = LeViTStyle().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):  # trained statistics, so no fold is trivial
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
    return model, torch.randn(1, 4, 32)


def _converted(override: bool) -> tuple[Program, dict[str, int]]:
    model, x = _levit_style()
    run_log(clear=True)
    prog = convert_torch(model, (x,), override=override, minimum_deployment_target=ct.target.iOS18)
    rewrites: dict[str, int] = {}
    for pass_id, _, stats in run_log():
        rewrites[pass_id] = rewrites.get(pass_id, 0) + stats.rewrites
    return prog, rewrites


def _relative_error(prog: Program) -> float:
    model, x = _levit_style()
    with torch.no_grad():
        expected = model.double()(x.double()).numpy()
    (name,) = prog.functions["main"].inputs
    (got,) = evaluate(prog, {name: x.numpy()}).values()
    return float(np.max(np.abs(got - expected)) / np.max(np.abs(expected)))


@pytest.fixture(scope="module")
def converted() -> dict[bool, tuple[Program, dict[str, int]]]:
    return {override: _converted(override) for override in (False, True)}


def test_levit_style_attentions_all_fuse_with_the_override(converted) -> None:
    (off, _), (on, rewrites) = converted[False], converted[True]
    assert op_counts(off)["softmax"] == 4 and op_counts(off)[SDPA] == 0
    assert op_counts(on)[SDPA] == 4
    assert op_counts(on)["softmax"] == 0 and op_counts(on)["matmul"] == 0
    assert rewrites[SDPA_PASS] == 4
    assert rewrites.get(BN_PASS, 0) == 0  # the N = 1 scores' mul + add went into the attention
    assert count_ops(on) < count_ops(off)


def test_levit_style_outputs_equal_pytorch(converted) -> None:
    # float32 weights folded by coremltools (batch norms into linears) against PyTorch in float64.
    for prog, _ in converted.values():
        assert _relative_error(prog) < 1e-7


def test_sdpa_runs_before_elementwise_to_batchnorm(converted) -> None:
    _, rewrites = converted[True]
    order = list(rewrites)
    assert order.index(SDPA_PASS) < order.index(BN_PASS)


def _unit_attention() -> Program:
    """LeViT's attention at resolution 1 as it reaches the passes: scores ``[1, H, 1, 1]``."""
    heads, e = 2, 16
    bias = np.random.default_rng(0).standard_normal((heads, 1, 1)).astype(np.float32)

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, heads, 1, e)) for _ in range(2)]
        + [mb.TensorSpec(shape=(1, heads, 1, 8))],
        opset_version=ct.target.iOS18,
    )
    def prog(q, k, v):
        key_t = mb.transpose(x=k, perm=[0, 1, 3, 2])
        scores = mb.add(x=mb.mul(x=mb.matmul(x=q, y=key_t), y=np.float32(1 / math.sqrt(e))), y=bias)
        return mb.matmul(x=mb.softmax(x=scores, axis=-1), y=v)

    return prog


def test_the_two_passes_compete_for_the_scores() -> None:
    # Either order fuses; batch_norm first leaves the attention written out (4 ops, not 1).
    prog = _unit_attention()
    sdpa_first = run_pass(BN_PASS, run_pass(SDPA_PASS, prog))
    bn_first = run_pass(SDPA_PASS, run_pass(BN_PASS, prog))
    assert op_types(sdpa_first) == [SDPA]
    assert op_types(bn_first) == ["transpose", "matmul", "batch_norm", "softmax", "matmul"]


def _timm_levit(size: int) -> tuple[nn.Module, torch.Tensor]:
    """timm's levit_128s for ``size`` x ``size`` images, random weights and batch-norm statistics."""
    import sys
    import types

    # torchvision's C ops do not load beside the CPU torch; timm imports it (see the preamble's shim).
    sys.modules.setdefault(
        "torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations")
    )
    import timm

    torch.manual_seed(0)
    model = timm.create_model("levit_128s", pretrained=False, img_size=size).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
                module.running_mean.normal_(0, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
            if hasattr(module, "attention_biases"):
                module.attention_biases.normal_()
    return model, torch.randn(1, 3, size, size)


@pytest.mark.slow
def test_timm_levit_fuses_every_attention() -> None:
    # At 64 x 64 the last stage's 4 attentions have resolution 1: they were the 4 of 11 left unfused.
    model, x = _timm_levit(64)
    with torch.no_grad():
        expected = model(x).numpy()
    run_log(clear=True)
    prog = convert_torch(model, (x,), override=True, minimum_deployment_target=ct.target.iOS18)
    assert op_counts(prog)[SDPA] == 11 and op_counts(prog)["softmax"] == 0
    assert sum(s.rewrites for pass_id, _, s in run_log() if pass_id == BN_PASS) == 0
    (name,) = prog.functions["main"].inputs
    (got,) = evaluate(prog, {name: x.numpy()}).values()
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) < 1e-5  # torch runs in float32
