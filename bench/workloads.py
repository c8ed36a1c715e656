"""Programs the benchmark rewrites: chains of N copies of one fusible pattern, and a real model.

Every chain is a single block ``x -> [pattern -> relu] * N -> y``: each copy of the pattern reads the
previous ``relu`` and feeds the next one, so the copies are disjoint and every one of them must be fused.
The ``relu`` between copies keeps each pattern's input a plain op output with exactly the consumers the
pattern has (coremltools' generic matcher insists on that count).

* :func:`gelu_chain`: the tanh GELU, alternating coremltools' two association orders (pattern 1 on even
  copies, pattern 2 on odd ones) and writing operands the way a PyTorch export does (the constant on
  the right), so commutativity is exercised::

    x --> pow(3) --> mul(0.044715) --> add(x) --> mul(sqrt(2/pi)) --> tanh --> add(1) --> mul(0.5) --> mul(x)

* :func:`layernorm_chain`: the written-out layer norm in the form coremltools'
  ``common::fuse_layernorm_or_instancenorm`` fuses (its pattern 1, axes ``[-1]``)::

      x --> reduce_mean --> sub(x - mean) --> square --> reduce_mean --> add(eps) --> rsqrt --> mul(gamma)
      mul(x, mul_gamma) ; mul(mean, mul_gamma) --> sub(beta - .) --> add --> y

* :func:`conv_bn_chain`: ``conv`` (constant weight, with bias) followed by ``batch_norm`` (constant
  statistics), the pair coremltools' ``common::fuse_conv_batchnorm`` folds into one ``conv``.

* :func:`transformer_model`: a 24-layer pre-norm transformer in PyTorch, GELU as the tanh formula and
  LayerNorm written out ``w * (x - u) / torch.sqrt(var + eps) + b``, for a whole ``coremltools.convert``.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

__all__ = [
    "GELU_PATTERN_OPS",
    "conv_bn_chain",
    "gelu_chain",
    "layernorm_chain",
    "run_with_deep_stack",
    "transformer_model",
]

_T = TypeVar("_T")

_RECURSION_LIMIT = 20_000_000
"""Frames ``copy.deepcopy`` may nest in :func:`run_with_deep_stack`: enough for about 1M ops."""


def run_with_deep_stack(target: Callable[[], _T]) -> _T | None:
    """Calls ``target`` in a thread with a 1 GB stack and a high recursion limit: ``copy.deepcopy`` of
    a long chain recurses through every op, more than ten Python frames per op (a 100k-op chain
    needs more than a million; most of them live on the heap, the stack takes the rest). Returns its
    result (None if it raised; the thread reports it)."""
    sys.setrecursionlimit(_RECURSION_LIMIT)
    threading.stack_size(1024 * 1024 * 1024)
    result: list[_T] = []
    thread = threading.Thread(target=lambda: result.append(target()), name="bench")
    thread.start()
    thread.join()
    return result[0] if result else None


def bench_main(run: Callable[[], int | None]) -> int:
    """The entry point of a benchmark command: quiet coremltools, ``run`` in a deep-stack thread.

    Returns:
        ``run``'s exit code, or 1 when it raised (the thread reports the error).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    code = run_with_deep_stack(run)
    return 1 if code is None else code


GELU_PATTERN_OPS = ("pow", "mul", "add", "mul", "tanh", "add", "mul", "mul")
"""Non-const ops of one tanh GELU, in program order."""

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh(x: Any, i: int) -> Any:
    """One tanh GELU on ``x``; copy ``i`` uses pattern 1 if even, pattern 2 if odd."""
    p = f"g{i}_"
    cube = mb.pow(x=x, y=3.0, name=p + "pow")
    inner = mb.mul(x=cube, y=0.044715, name=p + "mul_1")
    inner = mb.add(x=x, y=inner, name=p + "add")
    inner = mb.mul(x=inner, y=_SQRT_2_OVER_PI, name=p + "mul_2")
    t = mb.tanh(x=inner, name=p + "tanh")
    one_plus = mb.add(x=t, y=1.0, name=p + "add_1")
    if i % 2 == 0:  # pattern 1: x * (0.5 * (1 + tanh(...)))
        half = mb.mul(x=one_plus, y=0.5, name=p + "mul")
        return mb.mul(x=x, y=half, name=p + "mul_3")
    half_x = mb.mul(x=x, y=0.5, name=p + "mul")  # pattern 2: (0.5 * x) * (1 + tanh(...))
    return mb.mul(x=half_x, y=one_plus, name=p + "mul_3")


def gelu_chain(n: int, shape: tuple[int, ...] = (1, 4, 8)) -> Program:
    """``n`` tanh GELUs, each followed by a ``relu``.

    Args:
        n: Number of GELU copies (each is 8 ops and 5 constants, plus the ``relu``).
        shape: Shape of the program input.

    Returns:
        The program.
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x: Any) -> Any:
        for i in range(n):
            x = mb.relu(x=_gelu_tanh(x, i), name=f"r{i}")
        return x

    return prog


def layernorm_chain(n: int, shape: tuple[int, ...] = (1, 4, 8), eps: float = 1e-5, seed: int = 0) -> Program:
    """``n`` written-out layer norms over the last axis, each followed by a ``relu``.

    Args:
        n: Number of layer-norm copies (11 ops each, plus the ``relu``).
        shape: Shape of the program input; gamma and beta have the shape of its last axis.
        eps: The epsilon added to the variance.
        seed: Seed of the random gamma and beta.

    Returns:
        The program.
    """
    rng = np.random.default_rng(seed)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)])
    def prog(x: Any) -> Any:
        for i in range(n):
            x = mb.relu(x=_layernorm(x, f"ln{i}_", rng, eps), name=f"r{i}")
        return x

    return prog


def _layernorm(x: Any, p: str, rng: np.random.Generator, eps: float = 1e-5) -> Any:
    """One written-out layer norm over the last axis of ``x`` (11 ops named ``p...``), random gamma
    and beta drawn from ``rng``."""
    d = x.shape[-1]
    gamma = rng.uniform(0.5, 1.5, size=(d,)).astype(np.float32)
    beta = rng.uniform(-0.5, 0.5, size=(d,)).astype(np.float32)
    mean = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name=p + "mean")
    centred = mb.sub(x=x, y=mean, name=p + "sub")
    sq = mb.square(x=centred, name=p + "square")
    var = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name=p + "var")
    var_eps = mb.add(x=var, y=np.float32(eps), name=p + "add_eps")
    inv = mb.rsqrt(x=var_eps, name=p + "rsqrt")
    scale = mb.mul(x=inv, y=gamma, name=p + "mul_gamma")
    scaled_x = mb.mul(x=x, y=scale, name=p + "mul_x")
    scaled_mean = mb.mul(x=mean, y=scale, name=p + "mul_mean")
    shift = mb.sub(x=beta, y=scaled_mean, name=p + "sub_beta")
    return mb.add(x=scaled_x, y=shift, name=p + "add_out")


def conv_bn_chain(n: int, channels: int = 8, spatial: int = 8, seed: int = 0) -> Program:
    """``n`` copies of ``conv(3x3, same, bias) -> batch_norm``, each followed by a ``relu``.

    Args:
        n: Number of conv / batch-norm pairs.
        channels: Channels in and out of every conv.
        spatial: Height and width of the input.
        seed: Seed of the random weights and statistics.

    Returns:
        The program.
    """
    rng = np.random.default_rng(seed)
    c = channels

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, c, spatial, spatial))])
    def prog(x: Any) -> Any:
        for i in range(n):
            p = f"cb{i}_"
            weight = rng.normal(0, 0.2, size=(c, c, 3, 3)).astype(np.float32)
            bias = rng.normal(0, 0.1, size=(c,)).astype(np.float32)
            conv = mb.conv(x=x, weight=weight, bias=bias, pad_type="same", name=p + "conv")
            bn = mb.batch_norm(
                x=conv,
                mean=rng.normal(0, 0.1, size=(c,)).astype(np.float32),
                variance=rng.uniform(0.5, 1.5, size=(c,)).astype(np.float32),
                gamma=rng.uniform(0.5, 1.5, size=(c,)).astype(np.float32),
                beta=rng.normal(0, 0.1, size=(c,)).astype(np.float32),
                epsilon=np.float32(1e-5),
                name=p + "bn",
            )
            x = mb.relu(x=bn, name=f"r{i}")
        return x

    return prog


def transformer_model(n_layers: int = 24) -> tuple[Any, tuple[Any, ...], str]:
    """A pre-norm transformer with decomposed GELU (tanh formula) and LayerNorm, in PyTorch.

    Uses ``pattern_infra.testing.models.prenorm_transformer`` with layer norms written inline
    (``w * (x - u) / torch.sqrt(var + eps) + b``) when it is there; otherwise builds the same model here.

    Args:
        n_layers: Number of transformer blocks.

    Returns:
        ``(module in eval mode, example args, where the builder came from)``.
    """
    try:
        from pattern_infra.testing.models import prenorm_transformer
    except ImportError:
        prenorm_transformer = None
    if prenorm_transformer is not None:
        try:
            module, args = prenorm_transformer(n_layers=n_layers, ln_style="inline")
            return module, args, "pattern_infra.testing.models.prenorm_transformer(ln_style='inline')"
        except TypeError:  # an older signature without ln_style
            module, args = prenorm_transformer(n_layers=n_layers)
            return module, args, "pattern_infra.testing.models.prenorm_transformer"
    module, args = _own_prenorm_transformer(n_layers)
    return module, args, "bench.workloads._own_prenorm_transformer"


def _own_prenorm_transformer(n_layers: int, d: int = 64, heads: int = 4, seq: int = 16) -> tuple[Any, Any]:
    """Fallback builder, used only when ``pattern_infra.testing.models`` has no ``prenorm_transformer``."""
    import torch
    from torch import nn

    class LayerNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.rand(d) + 0.5)
            self.b = nn.Parameter(torch.randn(d) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = x.mean(-1, keepdim=True)
            var = (x - u).pow(2).mean(-1, keepdim=True)
            return self.w * (x - u) / torch.sqrt(var + 1e-5) + self.b

    def gelu(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = LayerNorm(), LayerNorm()
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(gelu(self.fc1(self.ln2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.ln = LayerNorm()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for blk in self.blocks:
                x = blk(x)
            return self.ln(x)

    torch.manual_seed(0)
    return Model().eval(), (torch.randn(1, seq, d),)
