"""The zoo of real ``transformers`` model classes, built from tiny random configs (nothing downloaded).

Each builder constructs a config in code, seeds :func:`torch.manual_seed`, instantiates the library's own
model class and returns ``(module, example_args)`` like :mod:`pattern_infra.testing.models`. No weights,
tokenizers or configs are fetched: ``HF_HUB_OFFLINE=1`` is set before ``transformers`` is imported
(:func:`_transformers`), so an accidental download fails instead of hanging.

* Decoder-only LLMs (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-2) are called as users call them,
  ``model(input_ids).logits`` through the CausalLM class's own ``forward`` (default ``use_cache=True``).
  ``torch.export`` of that forward contains ``aten.alias`` and ``aten.where.ScalarOther``, which
  coremltools 9.0 rejects: :func:`pattern_infra.torch_support.install` registers their converters, and
  :func:`pattern_infra.testing.real_models.compare_model` calls it.
* Encoders (BERT, ViT, CLIP text, Whisper encoder) return ``last_hidden_state``; vision CNNs (ConvNeXt,
  MobileViT) their ``last_hidden_state`` too.
* Every class with both attention implementations is built twice, ``attn_implementation="eager"``
  (``<name>_eager``) and ``"sdpa"`` (``<name>_sdpa``); the others once.
* Norm weights, which the libraries initialise to 1 (0 for Gemma's ``1 + w``) and biases to 0, are
  redrawn, as in :mod:`pattern_infra.testing.models`: coremltools would otherwise delete ``mul`` by 1.

The grouped-query models use 4 query heads over 2 key/value heads (``repeat_kv`` with 2 groups).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .models import ModelAndArgs

__all__ = ["HF_ZOO", "FAST", "DECODER_LLMS", "GROUPED_KV"]

SEQ = 8
"""Sequence length of every text model's example input."""
VOCAB = 128
"""Vocabulary size of every text model."""

_LLM = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)


def _transformers() -> Any:
    """``transformers``, imported with the hub offline (set here, before the first import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    return transformers


class _Logits(nn.Module):
    """``model(input_ids).logits``: the CausalLM's own forward, as users call it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


class _LastHidden(nn.Module):
    """``model(**{name: x}).last_hidden_state``."""

    def __init__(self, model: nn.Module, arg: str) -> None:
        super().__init__()
        self.model = model
        self.arg = arg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.arg: x}).last_hidden_state


def _randomize_norms(model: nn.Module, one_plus: bool = False) -> None:
    """Redraw every norm's weight (around 1, or around 0 for ``1 + w`` norms) and bias."""
    with torch.no_grad():
        for module in model.modules():
            if "norm" not in type(module).__name__.lower():
                continue
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                weight.copy_((0.0 if one_plus else 1.0) + 0.1 * torch.randn_like(weight))
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(0.1 * torch.randn_like(bias))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ))


def _causal_lm(config_cls: str, model_cls: str, attn: str, one_plus: bool = False, **extra: Any) -> ModelAndArgs:
    tf = _transformers()
    torch.manual_seed(0)
    config = getattr(tf, config_cls)(**{**_LLM, **extra}, attn_implementation=attn)
    model = getattr(tf, model_cls)(config).eval()
    _randomize_norms(model, one_plus)
    return _Logits(model).eval(), (_ids(),)


def llama(attn: str) -> ModelAndArgs:
    """``LlamaForCausalLM``: RMSNorm, rotary embeddings, grouped-KV attention, SiLU-gated MLP."""
    return _causal_lm("LlamaConfig", "LlamaForCausalLM", attn)


def mistral(attn: str) -> ModelAndArgs:
    """``MistralForCausalLM`` (sliding window off at this length)."""
    return _causal_lm("MistralConfig", "MistralForCausalLM", attn)


def qwen2(attn: str) -> ModelAndArgs:
    """``Qwen2ForCausalLM``: Llama with biased q/k/v projections."""
    return _causal_lm("Qwen2Config", "Qwen2ForCausalLM", attn)


def gemma(attn: str) -> ModelAndArgs:
    """``GemmaForCausalLM``: RMSNorm ``x * (1 + w)`` computed in float32, tanh-GELU-gated MLP."""
    return _causal_lm("GemmaConfig", "GemmaForCausalLM", attn, one_plus=True, head_dim=16)


def phi3(attn: str) -> ModelAndArgs:
    """``Phi3ForCausalLM``: fused ``qkv_proj`` and ``gate_up_proj``."""
    return _causal_lm("Phi3Config", "Phi3ForCausalLM", attn, pad_token_id=0)


def gpt2(attn: str) -> ModelAndArgs:
    """``GPT2LMHeadModel``: ``Conv1D`` projections, layer norm, tanh GELU, boolean causal mask."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                           attn_implementation=attn)
    model = tf.GPT2LMHeadModel(config).eval()
    _randomize_norms(model)
    return _Logits(model).eval(), (_ids(),)


def bert(attn: str) -> ModelAndArgs:
    """``BertModel``: post-norm encoder, erf GELU."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64, attn_implementation=attn)
    model = tf.BertModel(config, add_pooling_layer=False).eval()
    _randomize_norms(model)
    return _LastHidden(model, "input_ids").eval(), (_ids(),)


def vit(attn: str) -> ModelAndArgs:
    """``ViTModel`` on a 32x32 image with 8x8 patches."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=128, attn_implementation=attn)
    model = tf.ViTModel(config, add_pooling_layer=False).eval()
    _randomize_norms(model)
    return _LastHidden(model, "pixel_values").eval(), (torch.randn(1, 3, 32, 32),)


def clip_text(attn: str) -> ModelAndArgs:
    """``CLIPTextModel``: pre-norm, quick GELU, causal mask."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.CLIPTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=SEQ, attn_implementation=attn)
    model = tf.CLIPTextModel(config).eval()
    _randomize_norms(model)
    return _LastHidden(model, "input_ids").eval(), (_ids(),)


def whisper_encoder(attn: str) -> ModelAndArgs:
    """``WhisperEncoder``: two convs over the mel spectrogram, then a pre-norm encoder."""
    tf = _transformers()
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    config = tf.WhisperConfig(num_mel_bins=16, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                              encoder_ffn_dim=128, max_source_positions=16, attn_implementation=attn)
    model = WhisperEncoder(config).eval()
    _randomize_norms(model)
    return _LastHidden(model, "input_features").eval(), (torch.randn(1, 16, 32),)


def convnext() -> ModelAndArgs:
    """``ConvNextModel``: depthwise convs, channels-last and channels-first layer norms, layer scale."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                               layer_scale_init_value=0.5)
    model = tf.ConvNextModel(config).eval()
    _randomize_norms(model)
    return _LastHidden(model, "pixel_values").eval(), (torch.randn(1, 3, 32, 32),)


def mobilevit() -> ModelAndArgs:
    """``MobileViTModel``: inverted residuals, batch norms, unfolded patches through transformer layers."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.MobileViTConfig(image_size=64, patch_size=2, hidden_sizes=[16, 24, 32],
                                neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48], num_attention_heads=2)
    model = tf.MobileViTModel(config, expand_output=False).eval()
    _randomize_norms(model)
    return _LastHidden(model, "pixel_values").eval(), (torch.randn(1, 3, 64, 64),)


def _both(builder: Callable[[str], ModelAndArgs]) -> dict[str, Callable[[], ModelAndArgs]]:
    name = builder.__name__
    return {f"{name}_{attn}": (lambda attn=attn: builder(attn)) for attn in ("eager", "sdpa")}


HF_ZOO: dict[str, Callable[[], ModelAndArgs]] = {
    **_both(llama), **_both(mistral), **_both(qwen2), **_both(gemma), **_both(phi3), **_both(gpt2),
    **_both(bert), **_both(vit), **_both(clip_text), **_both(whisper_encoder),
    "convnext": convnext, "mobilevit": mobilevit,
}
"""Every ``transformers`` zoo model by name, in a fixed order; each is callable with no argument."""

DECODER_LLMS: tuple[str, ...] = tuple(n for n in HF_ZOO if n.split("_")[0] in
                                      ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2"))
"""The decoder-only language models of :data:`HF_ZOO`."""

GROUPED_KV: tuple[str, ...] = tuple(n for n in HF_ZOO if n.split("_")[0] in ("llama", "mistral", "qwen2", "gemma"))
"""Models whose attention repeats K/V (``repeat_kv``) and must lose that repetition at iOS18."""

FAST: tuple[str, ...] = ("llama_sdpa", "gpt2_eager")
"""A few small models the default test run converts; ``make models`` converts them all."""
