"""LLM-size MIL programs for the whole-conversion benchmark (:mod:`bench.llm`).

* :func:`synthetic_mix`: a chain of residual units mixing what the project's fusions rewrite, repeated
  until the program holds the requested number of non-const ops (29 per unit)::

      x -> layer norm (11 ops, written out) -> matmul + add (linear) -> tanh GELU (8 ops)
        -> matmul + add (linear) -> add(x) -> reshape -> conv(3x3) -> batch_norm -> relu -> reshape -> x

* :func:`llama_decoder`: a Llama-style decoder written out the way a naive export writes it: per layer
  an RMS norm (``x * x``, mean, ``+ eps``, ``rsqrt``, two ``mul``), q/k/v projections, rotary embeddings
  (``rotate_half`` as two slices, a negation and a concat), causal attention written out per head
  (slice, matmul, scale, mask, softmax, matmul; heads concatenated), the output projection, and a
  SwiGLU MLP with SiLU written ``x * sigmoid(x)``; 32 layers of 8 heads by default (about 6.5k ops).

Both are built directly with ``mb`` (no PyTorch export), deterministically (seeded weights, fixed
names), so a benchmark builds a fresh copy for each run instead of copying one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

from .workloads import _gelu_tanh, _layernorm

__all__ = ["MIX_UNIT_OPS", "llama_decoder", "synthetic_mix"]

MIX_UNIT_OPS = 29
"""Non-const ops of one :func:`synthetic_mix` unit."""


def synthetic_mix(n_ops: int, d: int = 16, seq: int = 8, seed: int = 0) -> Program:
    """Residual units of layer norm, linear, GELU and conv/batch-norm, about ``n_ops`` non-const ops.

    Args:
        n_ops: Target number of non-const ops (rounded down to whole units, at least one).
        d: Hidden size (the conv sees ``d`` channels of ``seq // 2`` by 2).
        seq: Sequence length (even).
        seed: Seed of the weights.

    Returns:
        The program, input ``(1, seq, d)``.
    """
    rng = np.random.default_rng(seed)
    units = max(1, n_ops // MIX_UNIT_OPS)

    def weight(*shape: int, scale: float = 0.2) -> np.ndarray:
        return rng.normal(0, scale, size=shape).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, seq, d))])
    def prog(x: Any) -> Any:
        for i in range(units):
            p = f"u{i}_"
            h = _layernorm(x, p + "ln_", rng)
            h = mb.add(
                x=mb.matmul(x=h, y=weight(d, 2 * d), name=p + "fc1"), y=weight(2 * d), name=p + "fc1_b"
            )
            h = _gelu_tanh(h, i)
            h = mb.add(x=mb.matmul(x=h, y=weight(2 * d, d), name=p + "fc2"), y=weight(d), name=p + "fc2_b")
            x = mb.add(x=x, y=h, name=p + "res")
            c = mb.reshape(x=x, shape=[1, d, seq // 2, 2], name=p + "to_nchw")
            c = mb.conv(x=c, weight=weight(d, d, 3, 3), bias=weight(d), pad_type="same", name=p + "conv")
            c = mb.batch_norm(
                x=c,
                mean=weight(d, scale=0.1),
                variance=rng.uniform(0.5, 1.5, size=(d,)).astype(np.float32),
                gamma=rng.uniform(0.5, 1.5, size=(d,)).astype(np.float32),
                beta=weight(d, scale=0.1),
                epsilon=np.float32(1e-5),
                name=p + "bn",
            )
            c = mb.relu(x=c, name=p + "relu")
            x = mb.reshape(x=c, shape=[1, seq, d], name=p + "to_seq")
        return x

    return prog


def llama_decoder(
    n_layers: int = 32, heads: int = 8, head_dim: int = 16, ffn: int = 256, seq: int = 8, seed: int = 0
) -> Program:
    """A Llama-style decoder, written out (see the module docstring).

    Args:
        n_layers: Decoder layers.
        heads: Attention heads (written out one by one).
        head_dim: Size of each head (even).
        ffn: Hidden size of the MLP.
        seq: Sequence length.
        seed: Seed of the weights.

    Returns:
        The program, hidden states ``(1, seq, heads * head_dim)`` in and out.
    """
    rng = np.random.default_rng(seed)
    d = heads * head_dim
    half = head_dim // 2
    positions = np.arange(seq, dtype=np.float32)[:, None]
    freqs = positions / (10000.0 ** (np.arange(half, dtype=np.float32) / half))
    angles = np.concatenate([freqs, freqs], axis=-1)[None]  # (1, seq, head_dim)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    mask = np.triu(np.full((seq, seq), -1e4, dtype=np.float32), k=1)[None]
    scale = np.float32(1.0 / np.sqrt(head_dim))

    def weight(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.1, size=shape).astype(np.float32)

    def rms_norm(x: Any, p: str) -> Any:
        sq = mb.mul(x=x, y=x, name=p + "sq")
        mean = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name=p + "mean")
        inv = mb.rsqrt(x=mb.add(x=mean, y=np.float32(1e-6), name=p + "eps"), name=p + "rsqrt")
        return mb.mul(x=mb.mul(x=x, y=inv, name=p + "norm"), y=1.0 + weight(d), name=p + "scale")

    def rope(x: Any, p: str) -> Any:
        lo = mb.slice_by_index(x=x, begin=[0, 0, 0], end=[1, seq, half], name=p + "lo")
        hi = mb.slice_by_index(x=x, begin=[0, 0, half], end=[1, seq, head_dim], name=p + "hi")
        rotated = mb.concat(values=[mb.mul(x=hi, y=-1.0, name=p + "neg"), lo], axis=-1, name=p + "rot")
        return mb.add(
            x=mb.mul(x=x, y=cos, name=p + "cos"), y=mb.mul(x=rotated, y=sin, name=p + "sin"), name=p + "rope"
        )

    def head(q: Any, k: Any, v: Any, h: int, p: str) -> Any:
        lo, hi = [0, 0, h * head_dim], [1, seq, (h + 1) * head_dim]
        qh = rope(mb.slice_by_index(x=q, begin=lo, end=hi, name=p + "q"), p + "q_")
        kh = rope(mb.slice_by_index(x=k, begin=lo, end=hi, name=p + "k"), p + "k_")
        vh = mb.slice_by_index(x=v, begin=lo, end=hi, name=p + "v")
        scores = mb.matmul(x=qh, y=kh, transpose_y=True, name=p + "qk")
        scores = mb.add(x=mb.mul(x=scores, y=scale, name=p + "scaled"), y=mask, name=p + "masked")
        return mb.matmul(x=mb.softmax(x=scores, axis=-1, name=p + "softmax"), y=vh, name=p + "av")

    def linear(x: Any, n_in: int, n_out: int, name: str) -> Any:
        return mb.linear(x=x, weight=weight(n_out, n_in), name=name)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, seq, d))])
    def prog(x: Any) -> Any:
        for layer in range(n_layers):
            p = f"l{layer}_"
            h = rms_norm(x, p + "attn_norm_")
            q, k, v = (linear(h, d, d, p + name) for name in ("q_proj", "k_proj", "v_proj"))
            attn = [head(q, k, v, i, f"{p}h{i}_") for i in range(heads)]
            attn = mb.concat(values=attn, axis=-1, name=p + "heads")
            x = mb.add(x=x, y=linear(attn, d, d, p + "o_proj"), name=p + "attn_res")
            h = rms_norm(x, p + "mlp_norm_")
            gate = linear(h, d, ffn, p + "gate_proj")
            silu = mb.mul(x=gate, y=mb.sigmoid(x=gate, name=p + "sigmoid"), name=p + "silu")
            up = mb.mul(x=silu, y=linear(h, d, ffn, p + "up_proj"), name=p + "swiglu")
            x = mb.add(x=x, y=linear(up, ffn, d, p + "down_proj"), name=p + "mlp_res")
        return rms_norm(x, "final_norm_")

    return prog
