"""A small zoo of PyTorch models written the way popular model libraries write them.

Each builder returns ``(module, example_args)``: an ``eval()``-mode :class:`torch.nn.Module` and the tuple
of example inputs to export it with. Sizes are small so each model converts in a few seconds. Weights are
seeded with :func:`torch.manual_seed`, and every affine parameter that model libraries initialise to a
trivial value (layer-norm weight 1 and bias 0, batch-norm running statistics, ConvNeXt's ``1e-6`` layer
scale) is redrawn at random: a trained model never has those values, and coremltools' own passes would
otherwise delete ``mul`` by 1 and ``add`` of 0 and hide the pattern a fusion has to match.

The idioms copied are the ones found in the wild:

* the layer norm written out as a module, as Hugging Face's BERT ancestors and ConvNeXt write it
  (``u = x.mean(-1, keepdim=True); s = (x - u).pow(2).mean(-1, keepdim=True); ...``), and as a single
  expression ``w * (x - u) / torch.sqrt(var + eps) + b``;
* the channels-first layer norm of ConvNeXt (``weight[:, None, None] * x + bias[:, None, None]``);
* the tanh GELU of GPT-2 (``torch.pow(x, 3)``) and of JAX (``x * x * x``), BERT's erf GELU and
  CLIP's quick GELU (``x * torch.sigmoid(1.702 * x)``);
* GPT-2's ``Conv1D`` (``torch.addmm`` with an ``[in, out]`` weight) and its boolean causal mask;
* conv / batch-norm / ReLU residual stacks (ResNet) and the inverted residual block (MobileNetV2).

This module imports :mod:`torch` at import time; it is imported by tests, examples and benchmarks only,
never by :mod:`pattern_infra` itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "ChannelsFirstLayerNorm",
    "InlineLayerNorm",
    "LayerNormStyle",
    "ModelAndArgs",
    "WrittenLayerNorm",
    "ZOO",
    "bert_encoder",
    "clip_mlp",
    "convnext_stage",
    "gelu_erf",
    "gelu_tanh_cube",
    "gelu_tanh_pow",
    "gpt2_block",
    "jax_style_gelu_mlp",
    "llama_block",
    "mobilenet_block",
    "prenorm_transformer",
    "prenorm_transformer_inline_ln",
    "quick_gelu",
    "resnet_stack",
]

logger = logging.getLogger(__name__)

ModelAndArgs = tuple[nn.Module, tuple[torch.Tensor, ...]]
"""What every builder returns: the module in ``eval()`` mode and its example inputs."""

LayerNormStyle = Literal["module", "inline"]
"""How :func:`prenorm_transformer` writes layer norms: ``"module"`` or ``"inline"``."""


# --------------------------------------------------------------------------------------------------------
# Activations, written exactly as the libraries write them.
# --------------------------------------------------------------------------------------------------------


def gelu_tanh_pow(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU with ``torch.pow(x, 3)`` (GPT-2's ``NewGELU``, BERT-era ``gelu_new``)."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def gelu_tanh_cube(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU as ``jax.nn.gelu(approximate=True)`` lowers it: ``x ** 3`` is ``x * x * x``."""
    cdf = 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))
    return x * cdf


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU through ``erf``, as Google's BERT and Hugging Face's ``gelu`` write it."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


class NewGELU(nn.Module):
    """GPT-2's activation module (Hugging Face ``NewGELUActivation``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_pow(x)


# --------------------------------------------------------------------------------------------------------
# Normalisations written out by hand.
# --------------------------------------------------------------------------------------------------------


class WrittenLayerNorm(nn.Module):
    """Layer norm over the last axis, written out as Hugging Face / ConvNeXt code does."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight * x + self.bias


class InlineLayerNorm(nn.Module):
    """Layer norm over the last axis as the single expression ``w * (x - u) / sqrt(var + eps) + b``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        var = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - u) / torch.sqrt(var + self.eps) + self.bias


class ChannelsFirstLayerNorm(nn.Module):
    """ConvNeXt's ``LayerNorm(data_format="channels_first")``: normalises axis 1 of an NCHW tensor."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


def _randomize_affine(module: nn.Module) -> None:
    """Redraw normalisation parameters and statistics so none is the identity value a pass would drop."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.LayerNorm, WrittenLayerNorm, InlineLayerNorm, ChannelsFirstLayerNorm)):
                sub.weight.copy_(1.0 + 0.1 * torch.randn_like(sub.weight))
                sub.bias.copy_(0.1 * torch.randn_like(sub.bias))
            elif isinstance(sub, nn.BatchNorm2d):
                sub.weight.copy_(1.0 + 0.1 * torch.randn_like(sub.weight))
                sub.bias.copy_(0.1 * torch.randn_like(sub.bias))
                if sub.running_mean is not None and sub.running_var is not None:
                    sub.running_mean.copy_(0.1 * torch.randn_like(sub.running_mean))
                    sub.running_var.copy_(1.0 + 0.1 * torch.rand_like(sub.running_var))


# --------------------------------------------------------------------------------------------------------
# Pre-norm transformer (the model of `make demo` and of the scaling benchmark).
# --------------------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Multi-head self-attention written out: projections, head split, softmax(QK^T / sqrt(d)) V."""

    def __init__(self, d_model: int, n_heads: int, bias: bool = True) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, d_model, bias=bias)
        self.v_proj = nn.Linear(d_model, d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self._split(self.q_proj(x))
        k = self._split(self.k_proj(x))
        v = self._split(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
        return self.out_proj(ctx)


class TanhGeluMLP(nn.Module):
    """``Linear -> tanh GELU (pow form) -> Linear``."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu_tanh_pow(self.fc1(x)))


class PreNormBlock(nn.Module):
    """``x = x + attn(ln1(x)); x = x + mlp(ln2(x))``: the layer-norm input also feeds the residual add."""

    def __init__(
        self, d_model: int, n_heads: int, mlp_ratio: int, eps: float, ln_style: LayerNormStyle
    ) -> None:
        super().__init__()
        norm = WrittenLayerNorm if ln_style == "module" else InlineLayerNorm
        self.ln1 = norm(d_model, eps)
        self.attn = SelfAttention(d_model, n_heads)
        self.ln2 = norm(d_model, eps)
        self.mlp = TanhGeluMLP(d_model, mlp_ratio * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class PreNormTransformer(nn.Module):
    """A stack of :class:`PreNormBlock` followed by a final written-out layer norm."""

    def __init__(
        self, n_layers: int, d_model: int, n_heads: int, mlp_ratio: int, eps: float, ln_style: LayerNormStyle
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [PreNormBlock(d_model, n_heads, mlp_ratio, eps, ln_style) for _ in range(n_layers)]
        )
        self.ln_f = (WrittenLayerNorm if ln_style == "module" else InlineLayerNorm)(d_model, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def prenorm_transformer(
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    seq_len: int = 16,
    batch: int = 1,
    mlp_ratio: int = 4,
    eps: float = 1e-5,
    ln_style: LayerNormStyle = "module",
    seed: int = 0,
) -> ModelAndArgs:
    """Pre-norm residual transformer stack with written-out layer norms and the tanh (``pow``) GELU.

    Every block computes ``x = x + attn(ln1(x)); x = x + mlp(ln2(x))``; a final layer norm closes the
    stack, so a model of ``n_layers`` layers holds ``2 * n_layers + 1`` layer norms and ``n_layers`` GELUs.

    Args:
        n_layers: Number of transformer blocks.
        d_model: Model width (must be divisible by ``n_heads``).
        n_heads: Number of attention heads.
        seq_len: Sequence length of the example input.
        batch: Batch size of the example input.
        mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
        eps: Layer-norm epsilon.
        ln_style: ``"module"`` for the Hugging Face / ConvNeXt module
            (``(x - u) / torch.sqrt(s + eps)`` then ``weight * x + bias``), ``"inline"`` for the single
            expression ``w * (x - u) / torch.sqrt(var + eps) + b``.
        seed: Seed of :func:`torch.manual_seed` for weights and inputs.

    Returns:
        The module in eval mode and a one-tensor tuple of shape ``(batch, seq_len, d_model)``.

    Raises:
        ValueError: If ``d_model`` is not divisible by ``n_heads`` or ``ln_style`` is unknown.
    """
    if d_model % n_heads:
        raise ValueError(f"prenorm_transformer: d_model={d_model} is not divisible by n_heads={n_heads}")
    if ln_style not in ("module", "inline"):
        raise ValueError(f"prenorm_transformer: ln_style={ln_style!r}; use 'module' or 'inline'")
    torch.manual_seed(seed)
    model = PreNormTransformer(n_layers, d_model, n_heads, mlp_ratio, eps, ln_style)
    _randomize_affine(model)
    x = torch.randn(batch, seq_len, d_model)
    return model.eval(), (x,)


def prenorm_transformer_inline_ln(n_layers: int = 2, d_model: int = 64, seed: int = 0) -> ModelAndArgs:
    """:func:`prenorm_transformer` whose layer norms are ``w * (x - u) / torch.sqrt(var + eps) + b``.

    Args:
        n_layers: Number of transformer blocks.
        d_model: Model width.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and its example inputs.
    """
    return prenorm_transformer(n_layers=n_layers, d_model=d_model, ln_style="inline", seed=seed)


# --------------------------------------------------------------------------------------------------------
# GPT-2 (Hugging Face `modeling_gpt2`).
# --------------------------------------------------------------------------------------------------------


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: a linear layer with an ``[in, out]`` weight, computed with ``torch.addmm``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    """Causal self-attention with fused ``c_attn`` projection and a boolean ``tril`` mask buffer."""

    bias: torch.Tensor  # the registered mask buffer, declared for the type checker

    def __init__(self, d_model: int, n_heads: int, max_positions: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.d_model = d_model
        self.c_attn = Conv1D(3 * d_model, d_model)
        self.c_proj = Conv1D(d_model, d_model)
        tril = torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool))
        self.register_buffer("bias", tril.view(1, 1, max_positions, max_positions), persistent=False)

    def _split_heads(self, t: torch.Tensor) -> torch.Tensor:
        new_shape = t.size()[:-1] + (self.n_heads, self.head_dim)
        return t.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        attn = torch.matmul(q, k.transpose(-1, -2))
        attn = attn / torch.full([], v.size(-1) ** 0.5, dtype=attn.dtype)
        q_len, k_len = q.size(-2), k.size(-2)
        causal_mask = self.bias[:, :, k_len - q_len : k_len, :k_len]
        mask_value = torch.full([], torch.finfo(attn.dtype).min, dtype=attn.dtype)
        attn = torch.where(causal_mask, attn, mask_value)
        attn = F.softmax(attn, dim=-1)
        out = torch.matmul(attn, v).permute(0, 2, 1, 3).contiguous()
        out = out.view(out.size()[:-2] + (self.d_model,))
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    """``c_fc -> NewGELU -> c_proj`` with GPT-2's ``Conv1D`` layers."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(d_hidden, d_model)
        self.c_proj = Conv1D(d_model, d_hidden)
        self.act = NewGELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm GPT-2 block with :class:`torch.nn.LayerNorm` (``layer_norm_epsilon=1e-5``)."""

    def __init__(self, d_model: int, n_heads: int, max_positions: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = GPT2Attention(d_model, n_heads, max_positions)
        self.ln_2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = GPT2MLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


def gpt2_block(
    d_model: int = 64, n_heads: int = 4, seq_len: int = 16, max_positions: int = 64, seed: int = 0
) -> ModelAndArgs:
    """One Hugging Face GPT-2 block: ``nn.LayerNorm``, ``Conv1D`` (``addmm``), causal mask, ``NewGELU``.

    Args:
        d_model: Model width.
        n_heads: Number of heads.
        seq_len: Sequence length of the example input.
        max_positions: Side of the causal-mask buffer (GPT-2's ``n_positions``). It must exceed
            ``seq_len``, as in the real model: a slice covering the whole buffer is exported as
            ``aten.alias``, which coremltools 9.0 cannot convert.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and a ``(1, seq_len, d_model)`` input.

    Raises:
        ValueError: If ``max_positions <= seq_len``.
    """
    if max_positions <= seq_len:
        raise ValueError(f"gpt2_block: max_positions={max_positions} must exceed seq_len={seq_len}")
    torch.manual_seed(seed)
    model = GPT2Block(d_model, n_heads, max_positions)
    _randomize_affine(model)
    return model.eval(), (torch.randn(1, seq_len, d_model),)


# --------------------------------------------------------------------------------------------------------
# BERT (Hugging Face `modeling_bert`), post-norm.
# --------------------------------------------------------------------------------------------------------


class BertSelfAttention(nn.Module):
    """Query/key/value projections, additive attention mask, softmax, context."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)

    def _transpose_for_scores(self, t: torch.Tensor) -> torch.Tensor:
        new_shape = t.size()[:-1] + (self.n_heads, self.head_dim)
        return t.view(new_shape).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor, extended_mask: torch.Tensor) -> torch.Tensor:
        q = self._transpose_for_scores(self.query(x))
        k = self._transpose_for_scores(self.key(x))
        v = self._transpose_for_scores(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores + extended_mask
        probs = nn.functional.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.size()[:-2] + (self.n_heads * self.head_dim,))


class BertLayer(nn.Module):
    """Post-norm encoder layer: ``LayerNorm(dense(attn) + x)``, ``LayerNorm(dense(gelu(dense(h))) + h)``."""

    def __init__(self, d_model: int, n_heads: int, d_hidden: int) -> None:
        super().__init__()
        self.attention = BertSelfAttention(d_model, n_heads)
        self.attn_out = nn.Linear(d_model, d_model)
        self.attn_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.intermediate = nn.Linear(d_model, d_hidden)
        self.output = nn.Linear(d_hidden, d_model)
        self.out_norm = nn.LayerNorm(d_model, eps=1e-12)

    def forward(self, x: torch.Tensor, extended_mask: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(self.attn_out(self.attention(x, extended_mask)) + x)
        return self.out_norm(self.output(gelu_erf(self.intermediate(h))) + h)


class BertEncoder(nn.Module):
    """A stack of :class:`BertLayer`; the 0/1 attention mask becomes Hugging Face's additive mask."""

    def __init__(self, n_layers: int, d_model: int, n_heads: int, d_hidden: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(d_model, n_heads, d_hidden) for _ in range(n_layers)])

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        extended = attention_mask[:, None, None, :].to(hidden.dtype)
        extended = (1.0 - extended) * torch.finfo(hidden.dtype).min
        for layer in self.layer:
            hidden = layer(hidden, extended)
        return hidden


def bert_encoder(
    n_layers: int = 2, d_model: int = 64, n_heads: int = 4, seq_len: int = 16, seed: int = 0
) -> ModelAndArgs:
    """Hugging Face BERT encoder layers: post-norm ``nn.LayerNorm(eps=1e-12)``, erf GELU, additive mask.

    Args:
        n_layers: Number of encoder layers.
        d_model: Model width.
        n_heads: Number of heads.
        seq_len: Sequence length of the example input.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and ``(hidden_states, attention_mask)``: a ``(1, seq_len, d_model)``
        float tensor and a ``(1, seq_len)`` float 0/1 mask whose last quarter is padding.
    """
    torch.manual_seed(seed)
    model = BertEncoder(n_layers, d_model, n_heads, 4 * d_model)
    _randomize_affine(model)
    hidden = torch.randn(1, seq_len, d_model)
    mask = torch.ones(1, seq_len)
    mask[:, seq_len - seq_len // 4 :] = 0.0
    return model.eval(), (hidden, mask)


# --------------------------------------------------------------------------------------------------------
# ConvNeXt.
# --------------------------------------------------------------------------------------------------------


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, channels-first layer norm, pointwise convs with GELU, layer scale, residual."""

    def __init__(self, dim: int, layer_scale_init: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = ChannelsFirstLayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Conv2d(dim, 4 * dim, kernel_size=1)
        self.act = nn.GELU()
        self.pwconv2 = nn.Conv2d(4 * dim, dim, kernel_size=1)
        self.gamma = nn.Parameter(layer_scale_init * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.dwconv(x)
        x = self.norm(x)
        x = self.pwconv1(x)
        x = self.act(x)
        x = self.pwconv2(x)
        x = self.gamma[:, None, None] * x
        return shortcut + x


class ConvNeXtStage(nn.Module):
    """ConvNeXt downsampling layer (channels-first layer norm, 2x2 stride-2 conv) followed by blocks."""

    def __init__(self, in_dim: int, dim: int, depth: int) -> None:
        super().__init__()
        self.downsample = nn.Sequential(
            ChannelsFirstLayerNorm(in_dim, eps=1e-6), nn.Conv2d(in_dim, dim, kernel_size=2, stride=2)
        )
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


def convnext_stage(
    in_dim: int = 16, dim: int = 32, depth: int = 2, spatial: int = 16, seed: int = 0
) -> ModelAndArgs:
    """A ConvNeXt stage in NCHW with channels-first layer norms (``weight[:, None, None]``).

    Args:
        in_dim: Channels of the input.
        dim: Channels of the stage.
        depth: Number of blocks.
        spatial: Height and width of the input.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and a ``(1, in_dim, spatial, spatial)`` input.
    """
    torch.manual_seed(seed)
    model = ConvNeXtStage(in_dim, dim, depth)
    _randomize_affine(model)
    with torch.no_grad():
        for block in model.modules():
            if isinstance(block, ConvNeXtBlock):
                block.gamma.copy_(0.5 + 0.1 * torch.randn_like(block.gamma))
    return model.eval(), (torch.randn(1, in_dim, spatial, spatial),)


# --------------------------------------------------------------------------------------------------------
# CLIP MLP.
# --------------------------------------------------------------------------------------------------------


class CLIPMLPBlock(nn.Module):
    """CLIP encoder half-layer: ``x + fc2(quick_gelu(fc1(layer_norm(x))))``."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-5)
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(quick_gelu(self.fc1(self.layer_norm(x))))


def clip_mlp(d_model: int = 64, seq_len: int = 16, seed: int = 0) -> ModelAndArgs:
    """CLIP's MLP with quick GELU ``x * torch.sigmoid(1.702 * x)``, pre-norm and residual.

    Args:
        d_model: Model width (hidden width is ``4 * d_model``).
        seq_len: Sequence length of the example input.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and a ``(1, seq_len, d_model)`` input.
    """
    torch.manual_seed(seed)
    model = CLIPMLPBlock(d_model, 4 * d_model)
    _randomize_affine(model)
    return model.eval(), (torch.randn(1, seq_len, d_model),)


# --------------------------------------------------------------------------------------------------------
# ResNet and MobileNetV2 (torchvision).
# --------------------------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` with an optional 1x1-conv/BN downsample on the shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet_stack(channels: int = 16, spatial: int = 16, seed: int = 0) -> ModelAndArgs:
    """ResNet stem (conv/BN/ReLU) and two basic blocks, the second one downsampling.

    Args:
        channels: Channels after the stem.
        spatial: Height and width of the ``(1, 3, spatial, spatial)`` input.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode (batch norms use random running statistics) and its input.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        BasicBlock(channels, channels, stride=1),
        BasicBlock(channels, 2 * channels, stride=2),
    )
    _randomize_affine(model)
    return model.eval(), (torch.randn(1, 3, spatial, spatial),)


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: expand 1x1, depthwise 3x3, project 1x1, residual when shapes match."""

    def __init__(self, in_ch: int, out_ch: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = in_ch * expand_ratio
        self.use_res_connect = in_ch == out_ch
        self.conv = nn.Sequential(
            nn.Conv2d(in_ch, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


def mobilenet_block(
    channels: int = 16, expand_ratio: int = 6, spatial: int = 16, seed: int = 0
) -> ModelAndArgs:
    """One MobileNetV2 inverted residual block with its residual connection.

    Args:
        channels: Input and output channels.
        expand_ratio: Expansion of the hidden width.
        spatial: Height and width of the input.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and a ``(1, channels, spatial, spatial)`` input.
    """
    torch.manual_seed(seed)
    model = InvertedResidual(channels, channels, expand_ratio)
    _randomize_affine(model)
    return model.eval(), (torch.randn(1, channels, spatial, spatial),)


# --------------------------------------------------------------------------------------------------------
# JAX-style GELU MLP.
# --------------------------------------------------------------------------------------------------------


class JaxGeluMLP(nn.Module):
    """Flax-style ``Dense -> gelu(approximate=True) -> Dense`` with the cube written ``x * x * x``."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.dense_in = nn.Linear(d_model, d_hidden)
        self.dense_out = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_out(gelu_tanh_cube(self.dense_in(x)))


def jax_style_gelu_mlp(d_model: int = 64, seq_len: int = 16, seed: int = 0) -> ModelAndArgs:
    """MLP whose tanh GELU is ``x * (0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * (x * x * x)))))``.

    Args:
        d_model: Model width (hidden width is ``4 * d_model``).
        seq_len: Sequence length of the example input.
        seed: Seed of :func:`torch.manual_seed`.

    Returns:
        The module in eval mode and a ``(1, seq_len, d_model)`` input.
    """
    torch.manual_seed(seed)
    model = JaxGeluMLP(d_model, 4 * d_model)
    return model.eval(), (torch.randn(1, seq_len, d_model),)


# --------------------------------------------------------------------------------------------------------
# A Llama block: RMSNorm, then attention of head size 128 (the saved-package tests).
# --------------------------------------------------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    """Llama's RMSNorm as ``transformers`` writes it: ``weight * (x * rsqrt(mean(x^2) + eps))``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class LlamaBlock(nn.Module):
    """``x + attn(norm(x))`` with bias-free projections, as a Llama decoder layer's first half."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


def llama_block(n_heads: int = 2, head_dim: int = 128, seq_len: int = 8, seed: int = 0) -> ModelAndArgs:
    """RMSNorm then written-out attention of head size 128, the sizes of Llama's heads.

    ``1 / sqrt(128)`` is not exact in float16 (``0.08837890625`` against ``0.0883883...``), so a model
    saved at float16 holds a scale that differs from the op's own ``1 / sqrt(E)`` by float16's rounding.
    Not in :data:`ZOO`: its attention fuses at iOS18 only, and the zoo converts at iOS16.

    Args:
        n_heads: Number of attention heads.
        head_dim: Size of each head.
        seq_len: Sequence length of the example input.
        seed: Seed of :func:`torch.manual_seed` for weights and inputs.

    Returns:
        The module in eval mode and a ``(1, seq_len, n_heads * head_dim)`` input.
    """
    torch.manual_seed(seed)
    model = LlamaBlock(n_heads * head_dim, n_heads)
    with torch.no_grad():
        model.norm.weight.copy_(1.0 + 0.1 * torch.randn_like(model.norm.weight))
    return model.eval(), (torch.randn(1, seq_len, n_heads * head_dim),)


ZOO: dict[str, Callable[[], ModelAndArgs]] = {
    "prenorm_transformer": prenorm_transformer,
    "prenorm_transformer_inline_ln": prenorm_transformer_inline_ln,
    "gpt2_block": gpt2_block,
    "bert_encoder": bert_encoder,
    "convnext_stage": convnext_stage,
    "clip_mlp": clip_mlp,
    "resnet_stack": resnet_stack,
    "mobilenet_block": mobilenet_block,
    "jax_style_gelu_mlp": jax_style_gelu_mlp,
}
"""Every model builder by name, in a fixed order; each is callable with no argument."""
