"""A stateful KV-cache decoder, written the way Apple's guide to LLMs on iOS 18 writes it.

The guide ("On Device Llama 3.1 with Core ML") keeps the key/value cache in model state: the PyTorch
module registers the cache as buffers and updates them in place with a slice assignment; the conversion
declares each buffer a ``coremltools.StateType``, targets iOS18, and lets the query length and the cache
length vary. :class:`StatefulDecoder` is a tiny Llama-style decoder written that way, with random
weights drawn in code (nothing downloaded):

* two layers of RMSNorm, rotary embeddings (``rotate_half`` with ``cat(-x2, x1)``), grouped-query
  attention (4 query heads over 2 key/value heads, ``repeat_kv`` as ``transformers`` writes it) written
  out as ``softmax(q @ k^T / sqrt(d) + mask) @ v``, and a SiLU-gated MLP;
* the cache: two buffers ``keyCache`` and ``valueCache`` of shape ``[layers, 1, kv_heads, CONTEXT,
  head_dim]``, written with ``self.keyCache[i, :, :, begin:end] = k`` and read back with
  ``self.keyCache[i, :, :, :end]``;
* the inputs, as in the guide: ``input_ids [1, L]`` and an additive ``causal_mask [1, 1, L, S]``; the
  tokens already in the cache are ``S - L``, the query's positions run from ``S - L`` to ``S``.

:func:`export_decoder` exports it with ``torch.export`` either with dynamic dims (``torch.export.Dim``
for ``L`` and ``S``: one program serves the prefill and every decode step) or static at a decode step's
shapes; :func:`convert_decoder` converts the export with the two states (fp16, the only state dtype
Core ML has). :func:`run_steps` runs a converted program over a prefill and decode steps with the
reference evaluator, the state carried from call to call, and :func:`torch_steps` runs the module over
the same steps; :func:`measure` (``python -m pattern_infra.testing.stateful``) tables the op counts and
errors of both variants with the override off and on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

__all__ = [
    "CONTEXT",
    "STATE_NAMES",
    "Step",
    "StatefulDecoder",
    "convert_decoder",
    "decode_steps",
    "export_decoder",
    "measure",
    "relative_error",
    "run_steps",
    "stateful_decoder",
    "torch_cache",
    "torch_steps",
]

CONTEXT = 16
"""Cache length (tokens) of the decoder's state."""
STATE_NAMES = ("keyCache", "valueCache")
"""The names of the cache buffers, which are the names of the converted model's states."""
VOCAB = 64
"""Vocabulary size."""


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, as ``transformers``' ``LlamaRMSNorm`` writes it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` on the last axis (``transformers``' ``rotate_half``)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each key/value head repeated ``n_rep`` times (``transformers``' ``repeat_kv``)."""
    batch, heads, length, dim = x.shape
    x = x[:, :, None, :, :].expand(batch, heads, n_rep, length, dim)
    return x.reshape(batch, heads * n_rep, length, dim)


class Layer(nn.Module):
    """One pre-norm decoder layer; attention reads and writes the shared cache buffers of its parent."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.input_norm = RMSNorm(dim)
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.post_norm = RMSNorm(dim)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)


class StatefulDecoder(nn.Module):
    """A tiny Llama-style decoder whose KV cache is two registered buffers updated in place.

    Args:
        layers: Decoder layers.
        dim: Model width.
        heads: Query heads.
        kv_heads: Key/value heads (``heads`` must be a multiple).
        hidden: MLP width.
    """

    # registered buffers, declared for the type checker (nn.Module's attribute lookup is untyped)
    inv_freq: torch.Tensor
    keyCache: torch.Tensor
    valueCache: torch.Tensor

    def __init__(
        self, layers: int = 2, dim: int = 32, heads: int = 4, kv_heads: int = 2, hidden: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)
        head_dim = dim // heads
        self.register_buffer(
            "inv_freq", 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)), persistent=False
        )
        shape = (layers, 1, kv_heads, CONTEXT, head_dim)
        self.register_buffer("keyCache", torch.zeros(shape))
        self.register_buffer("valueCache", torch.zeros(shape))

    def forward(self, input_ids: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        length, end = input_ids.shape[-1], causal_mask.shape[-1]
        begin = end - length
        positions = torch.arange(begin, end, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        x = self.embed(input_ids)
        for index, layer in enumerate(cast(Sequence[Layer], self.layers)):
            x = x + self._attention(layer, index, layer.input_norm(x), cos, sin, causal_mask, begin, end)
            h = layer.post_norm(x)
            x = x + layer.down_proj(nn.functional.silu(layer.gate_proj(h)) * layer.up_proj(h))
        return self.lm_head(self.norm(x))

    def _attention(
        self,
        layer: Layer,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        begin: Any,
        end: Any,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = layer.q_proj(x).view(batch, length, layer.heads, layer.head_dim).transpose(1, 2)
        k = layer.k_proj(x).view(batch, length, layer.kv_heads, layer.head_dim).transpose(1, 2)
        v = layer.v_proj(x).view(batch, length, layer.kv_heads, layer.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.keyCache[index, :, :, begin:end] = k
        self.valueCache[index, :, :, begin:end] = v
        groups = layer.heads // layer.kv_heads
        keys = repeat_kv(self.keyCache[index, :, :, :end], groups)
        values = repeat_kv(self.valueCache[index, :, :, :end], groups)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(layer.head_dim) + mask
        out = torch.softmax(scores, dim=-1) @ values
        return layer.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def reset(self) -> None:
        """Empties the cache: zeros, the state the evaluator starts from (``initial_state``)."""
        self.keyCache.zero_()
        self.valueCache.zero_()


def stateful_decoder(seed: int = 0) -> StatefulDecoder:
    """:class:`StatefulDecoder` with weights drawn from ``seed``, in ``eval()`` mode, cache empty."""
    torch.manual_seed(seed)
    return StatefulDecoder().eval()


@dataclass(frozen=True)
class Step:
    """One call of the decoder: the new tokens and the causal mask over everything cached so far."""

    input_ids: np.ndarray
    """``[1, L]`` int32 token ids."""
    causal_mask: np.ndarray
    """``[1, 1, L, S]`` float32 additive mask: 0 where a query may look, -1e4 where it may not."""


def _step(tokens: np.ndarray, past: int) -> Step:
    length = tokens.shape[-1]
    end = past + length
    allowed = np.arange(end)[None, :] <= (past + np.arange(length))[:, None]
    mask = np.where(allowed, 0.0, -1e4).astype(np.float32)[None, None]
    return Step(tokens.reshape(1, length).astype(np.int32), mask)


def decode_steps(prefill: int = 4, decodes: int = 2, seed: int = 1) -> list[Step]:
    """A prefill of ``prefill`` tokens, then ``decodes`` steps of one token each (random ids)."""
    rng = np.random.default_rng(seed)
    steps, past = [], 0
    for length in [prefill] + [1] * decodes:
        steps.append(_step(rng.integers(0, VOCAB, length), past))
        past += length
    return steps


def export_decoder(module: StatefulDecoder, *, flexible: bool = True, step: Step | None = None) -> Any:
    """``torch.export`` of the decoder, with dynamic query and cache lengths or static at ``step``'s shapes.

    Args:
        module: The decoder (its cache is not changed: export only traces).
        flexible: Dynamic dims ``L`` (query length) and ``S`` (cache length), each from 1 to
            ``CONTEXT - 1`` (at ``CONTEXT`` the slice assignment covers the whole cache and ``torch.export``
            specializes it); otherwise every shape is ``step``'s.
        step: The example inputs; by default two tokens after four (flexible: an example length of 1
            would make ``torch.export`` specialize the query length to 1), or the first decode step
            after a 4-token prefill (static).

    Returns:
        The exported program (``run_decompositions({})`` applied).
    """
    step = step or (_step(np.arange(2), 4) if flexible else decode_steps()[1])
    args = (torch.from_numpy(step.input_ids).long(), torch.from_numpy(step.causal_mask))
    dynamic = None
    if flexible:
        query, cache = (torch.export.Dim(name, min=1, max=CONTEXT - 1) for name in ("query", "cache"))
        dynamic = {"input_ids": {1: query}, "causal_mask": {2: query, 3: cache}}
    saved = [buffer.clone() for buffer in (module.keyCache, module.valueCache)]
    exported = torch.export.export(module.eval(), args, dynamic_shapes=dynamic).run_decompositions({})
    with torch.no_grad():
        module.keyCache.copy_(saved[0])
        module.valueCache.copy_(saved[1])
    return exported


def convert_decoder(exported: Any, *, override: bool, **convert_kwargs: Any) -> Any:
    """Converts an export of the decoder with its two states (fp16) at iOS18; returns the ``MLModel``.

    The converters of :func:`pattern_infra.pytorch.torch_support.install` are installed first, as a user
    converting a PyTorch model installs them: its ``copy`` writes each cache update as it is, the same program
    under every ``PYTHONHASHSEED`` (``docs/MODELS.md``).

    Args:
        exported: From :func:`export_decoder`.
        override: Whether the generic-pass override is on.
        **convert_kwargs: More arguments for :func:`coremltools.convert` (FLOAT32 compute precision by
            default, as every conversion of :mod:`.convert`).
    """
    import coremltools as ct

    from ..pytorch import torch_support
    from .convert import convert_exported_model

    torch_support.install()
    buffers = dict(exported.named_buffers())
    states = [
        ct.StateType(
            wrapped_type=ct.TensorType(shape=tuple(buffers[name].shape), dtype=np.float16), name=name
        )
        for name in STATE_NAMES
    ]
    convert_kwargs.setdefault("minimum_deployment_target", ct.target.iOS18)
    return convert_exported_model(exported, override=override, states=states, **convert_kwargs)


def run_steps(
    prog: Any, steps: Sequence[Step], state: dict[str, np.ndarray] | None = None
) -> list[np.ndarray]:
    """Runs a converted decoder over ``steps`` with the reference evaluator (float64).

    The state is one mapping carried from call to call, as an ``MLState`` is on a device.

    Args:
        prog: The converted program.
        steps: The calls, in order.
        state: The cache to start from (e.g. :func:`torch_cache`); by default empty
            (:func:`~pattern_infra.verification.evaluator.initial_state`). It is updated in place.

    Returns:
        The logits of each step.
    """
    from ..verification.evaluator import evaluate, initial_state

    state = initial_state(prog) if state is None else state
    outputs = []
    for step in steps:
        result = evaluate(prog, {"input_ids": step.input_ids, "causal_mask": step.causal_mask}, state=state)
        (logits,) = result.values()
        outputs.append(logits)
    return outputs


def torch_steps(module: StatefulDecoder, steps: Sequence[Step]) -> list[np.ndarray]:
    """Runs the PyTorch decoder over ``steps`` from an empty cache (emptied again afterwards).

    Returns:
        The logits of each step.
    """
    return _torch_run(module, steps)[0]


def torch_cache(module: StatefulDecoder, steps: Sequence[Step]) -> dict[str, np.ndarray]:
    """The cache buffers after the PyTorch decoder ran ``steps`` from an empty cache (emptied again)."""
    return _torch_run(module, steps)[1]


def _torch_run(
    module: StatefulDecoder, steps: Sequence[Step]
) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    module.reset()
    outputs = []
    with torch.no_grad():
        for step in steps:
            logits = module(torch.from_numpy(step.input_ids).long(), torch.from_numpy(step.causal_mask))
            outputs.append(logits.numpy())
        cache = {name: getattr(module, name).numpy().copy() for name in STATE_NAMES}
    module.reset()
    return outputs, cache


def relative_error(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """The largest ``max|got - want| / max|want|`` over the steps."""
    return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for g, w in zip(got, want, strict=True))


def measure(seed: int = 0) -> list[dict[str, Any]]:
    """Converts the decoder flexible and static, override off and on; counts ops and measures the error.

    The flexible program runs a prefill of 4 tokens and two decode steps from an empty cache; the static
    one (exported at the first decode step's shapes) runs that decode step from the cache PyTorch left
    after the prefill.

    Returns:
        One row per variant and override: ``variant``, ``override``, ``ops`` (without ``const``),
        ``tile``, ``sdpa``, ``state_ops`` (``read_state``, ``coreml_update_state``, ``slice_update``) and
        ``error`` (:func:`relative_error` against PyTorch).
    """
    from .convert import op_counts

    module, steps = stateful_decoder(seed), decode_steps()
    want = torch_steps(module, steps)
    rows = []
    for variant in ("flexible", "static"):
        exported = export_decoder(module, flexible=variant == "flexible")
        for override in (False, True):
            prog = convert_decoder(exported, override=override)._mil_program
            if variant == "flexible":
                error = relative_error(run_steps(prog, steps), want)
            else:
                error = relative_error(run_steps(prog, steps[1:2], torch_cache(module, steps[:1])), want[1:2])
            counts = op_counts(prog)
            counts.pop("const", None)
            rows.append(
                {
                    "variant": variant,
                    "override": override,
                    "ops": sum(counts.values()),
                    "tile": counts["tile"],
                    "sdpa": counts["scaled_dot_product_attention"],
                    "state_ops": tuple(
                        counts[t] for t in ("read_state", "coreml_update_state", "slice_update")
                    ),
                    "error": error,
                }
            )
    return rows


def main() -> None:
    """Prints :func:`measure` as a Markdown table (``python -m pattern_infra.testing.stateful``)."""
    print(
        "| variant | override | ops | tile | scaled_dot_product_attention | read_state / coreml_update_state "
        "/ slice_update | error against PyTorch |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in measure():
        state_ops = " / ".join(str(n) for n in row["state_ops"])
        print(
            f"| {row['variant']} | {'on' if row['override'] else 'off'} | {row['ops']} | {row['tile']} | "
            f"{row['sdpa']} | {state_ops} | {row['error']:.1e} |"
        )


if __name__ == "__main__":
    main()
