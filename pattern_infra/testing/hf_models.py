"""The zoo of real ``transformers`` model classes, built from tiny random configs (nothing downloaded).

Each builder constructs a config in code, seeds :func:`torch.manual_seed`, instantiates the library's own
model class and returns ``(module, example_args)`` like :mod:`pattern_infra.testing.models`. No weights,
tokenizers or configs are fetched: ``HF_HUB_OFFLINE=1`` is set before ``transformers`` is imported
(:func:`_transformers`), so an accidental download fails instead of hanging.

* Decoder-only LLMs (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-2) are called as users call them,
  ``model(input_ids).logits`` through the CausalLM class's own ``forward`` (default ``use_cache=True``).
  ``torch.export`` of that forward contains ``aten.alias`` and ``aten.where.ScalarOther``, which
  coremltools 9.0 rejects: :func:`pattern_infra.pytorch.torch_support.install` registers their converters, and
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
from functools import partial
from typing import Any

import torch
from torch import nn

from .models import ModelAndArgs
from .vision import install_torchvision_shim

__all__ = ["HF_ZOO", "FAST", "DECODER_LLMS", "GROUPED_KV", "BOTH_PRECISIONS", "ONLY_ATTENTION_LEFT"]

SEQ = 8
"""Sequence length of every text model's example input."""
VOCAB = 128
"""Vocabulary size of every text model."""

_LLM = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _transformers() -> Any:
    """``transformers``, imported with the hub offline (set here, before the first import) and torchvision
    importable: ``transformers`` imports torchvision whenever it is installed, and torchvision's wheel does
    not import beside the CPU torch without :func:`~pattern_infra.testing.vision.install_torchvision_shim`."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    install_torchvision_shim()
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


def _causal_lm(
    config_cls: str, model_cls: str, attn: str, one_plus: bool = False, **extra: Any
) -> ModelAndArgs:
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
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn
    )
    model = tf.GPT2LMHeadModel(config).eval()
    _randomize_norms(model)
    return _Logits(model).eval(), (_ids(),)


def bert(attn: str) -> ModelAndArgs:
    """``BertModel``: post-norm encoder, erf GELU."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    model = tf.BertModel(config, add_pooling_layer=False).eval()
    _randomize_norms(model)
    return _LastHidden(model, "input_ids").eval(), (_ids(),)


def _image_model(
    config_cls: str, model_cls: str, size: int, model_kwargs: dict[str, Any], **config: Any
) -> ModelAndArgs:
    """``model_cls(config_cls(**config), **model_kwargs)`` on a ``size`` x ``size`` RGB image, returning
    its ``last_hidden_state``."""
    tf = _transformers()
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, config_cls)(**config), **model_kwargs).eval()
    _randomize_norms(model)
    return _LastHidden(model, "pixel_values").eval(), (torch.randn(1, 3, size, size),)


def vit(attn: str) -> ModelAndArgs:
    """``ViTModel`` on a 32x32 image with 8x8 patches."""
    return _image_model(
        "ViTConfig",
        "ViTModel",
        32,
        dict(add_pooling_layer=False),
        image_size=32,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        attn_implementation=attn,
    )


def clip_text(attn: str) -> ModelAndArgs:
    """``CLIPTextModel``: pre-norm, quick GELU, causal mask."""
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        attn_implementation=attn,
    )
    model = tf.CLIPTextModel(config).eval()
    _randomize_norms(model)
    return _LastHidden(model, "input_ids").eval(), (_ids(),)


def whisper_encoder(attn: str) -> ModelAndArgs:
    """``WhisperEncoder``: two convs over the mel spectrogram, then a pre-norm encoder."""
    tf = _transformers()
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    torch.manual_seed(0)
    config = tf.WhisperConfig(
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        max_source_positions=16,
        attn_implementation=attn,
    )
    model = WhisperEncoder(config).eval()
    _randomize_norms(model)
    return _LastHidden(model, "input_features").eval(), (torch.randn(1, 16, 32),)


def convnext() -> ModelAndArgs:
    """``ConvNextModel``: depthwise convs, channels-last and channels-first layer norms, layer scale."""
    return _image_model(
        "ConvNextConfig",
        "ConvNextModel",
        32,
        {},
        num_channels=3,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_stages=2,
        layer_scale_init_value=0.5,
    )


def mobilevit() -> ModelAndArgs:
    """``MobileViTModel``: inverted residuals, batch norms, unfolded patches through transformer layers."""
    return _image_model(
        "MobileViTConfig",
        "MobileViTModel",
        64,
        dict(expand_output=False),
        image_size=64,
        patch_size=2,
        hidden_sizes=[16, 24, 32],
        neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48],
        num_attention_heads=2,
    )


def mixtral(attn: str) -> ModelAndArgs:
    """``MixtralForCausalLM``: sparse mixture of experts (4 experts, top 2) in every layer.

    The experts run as ``experts_implementation="batched_mm"`` (each token's chosen experts' weights
    gathered, one batched matmul): the library's default, ``grouped_mm``, sorts tokens and counts them
    with ``histc``, and its ``eager`` loop over the experts that were hit has data-dependent shapes that
    ``torch.export`` refuses; neither is a graph Core ML runs.

    Left as converted (decision): coremltools writes the token repetition (``repeat_interleave``) as
    ``tile``, ``reshape``, ``transpose``, ``reshape``. The same layout in 3 ops (``expand_dims``, ``tile``,
    ``reshape``) or in one ``gather`` with constant indices exists, but one op per MoE layer is not worth a
    pass, and a ``gather`` would move the copy off the Neural Engine. The per-token expert weights
    (``gather``, then a batched ``matmul`` between ``expand_dims`` and ``squeeze``) are the
    implementation's own computation.
    """
    return _causal_lm(
        "MixtralConfig",
        "MixtralForCausalLM",
        attn,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="batched_mm",
    )


def qwen2moe(attn: str) -> ModelAndArgs:
    """``Qwen2MoeForCausalLM``: 4 routed experts (top 2) plus a sigmoid-gated shared expert, biased q/k/v;
    experts as in :func:`mixtral`."""
    return _causal_lm(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        attn,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        experts_implementation="batched_mm",
    )


def qwen3(attn: str) -> ModelAndArgs:
    """``Qwen3ForCausalLM``: Llama-style, with an RMSNorm over each head of q and k."""
    return _causal_lm("Qwen3Config", "Qwen3ForCausalLM", attn, head_dim=16)


def gemma2(attn: str) -> ModelAndArgs:
    """``Gemma2ForCausalLM``: sliding-window layers (window 4 over 8 tokens) alternating with global ones,
    logit soft-capping, pre- and post-norms, tanh-GELU-gated MLP (eager attention only).

    The attention stays written out: its scores are soft-capped (``tanh(s / 50) * 50``) between the
    ``matmul`` and the ``softmax``, which ``scaled_dot_product_attention`` cannot express.
    """
    return _causal_lm("Gemma2Config", "Gemma2ForCausalLM", attn, one_plus=True, head_dim=16, sliding_window=4)


def starcoder2(attn: str) -> ModelAndArgs:
    """``Starcoder2ForCausalLM``: layer norms with biases, biased projections, tanh-GELU MLP, sliding
    window (4 over 8 tokens)."""
    return _causal_lm("Starcoder2Config", "Starcoder2ForCausalLM", attn, sliding_window=4)


def cohere(attn: str) -> ModelAndArgs:
    """``CohereForCausalLM``: interleaved rotary embeddings (rotate-half as ``stack(-x2, x1)``), a bias-free
    layer norm, parallel attention and MLP, scaled logits."""
    return _causal_lm("CohereConfig", "CohereForCausalLM", attn, logit_scale=0.5)


def falcon(attn: str) -> ModelAndArgs:
    """``FalconForCausalLM`` with multi-query attention (4 query heads, one key/value head), parallel
    attention and MLP, layer norms, exact GELU.

    ``sdpa``: coremltools broadcasts the single K/V head to the 4 query heads with a ``tile`` before its
    ``scaled_dot_product_attention``. ``eager``: the attention ``matmul``s broadcast the one head
    themselves (no ``tile``) and the attention stays written out: MIL's ``scaled_dot_product_attention``
    takes key and value with the query's heads (no broadcasting), so fusing it would first add the two
    ``tile``s ``generic::fuse_grouped_kv_attention`` removes elsewhere.
    """
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
        parallel_attn=True,
        bias=False,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    model = tf.FalconForCausalLM(config).eval()
    _randomize_norms(model)
    return _Logits(model).eval(), (_ids(),)


class _EncoderDecoder(nn.Module):
    """``model(input_ids=..., decoder_input_ids=...).last_hidden_state`` (the decoder's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False
        ).last_hidden_state


def t5(attn: str) -> ModelAndArgs:
    """``T5Model``: encoder-decoder with relative position buckets, RMS-style ``T5LayerNorm``, gated tanh
    GELU (``feed_forward_proj="gated-gelu"``, as Flan-T5); 8 source and 4 target tokens.

    The decoder's self-attention stays written out (decision): its scores are not scaled and get two
    constant additions, the relative position bias and then the causal mask; one addition of their sum
    rounds differently, so there is no exact identity to a single mask. The encoder's attention and the
    cross-attention fuse. At fp16 the override keeps the negative-index guard (``greater_equal``,
    ``select``) of the decoder's ids, which coremltools drops only because its ``add_int16_cast`` happens
    to cast them to ``uint16`` in its op order (see docs/MODELS.md).
    """
    tf = _transformers()
    torch.manual_seed(0)
    config = tf.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        attn_implementation=attn,
    )
    model = tf.T5Model(config).eval()
    _randomize_norms(model)
    return _EncoderDecoder(model).eval(), (_ids(), torch.randint(0, VOCAB, (1, SEQ // 2)))


def swin() -> ModelAndArgs:
    """``SwinModel``: windowed attention (4x4 windows, shifted in every second block) with relative
    position bias, patch merging; a 32x32 image in 4x4 patches."""
    return _image_model(
        "SwinConfig",
        "SwinModel",
        32,
        dict(add_pooling_layer=False),
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
    )


def siglip_vision(attn: str) -> ModelAndArgs:
    """``SiglipVisionModel``: pre-norm ViT with tanh GELU and an attention-pooling head; 32x32 image."""
    return _image_model(
        "SiglipVisionConfig",
        "SiglipVisionModel",
        32,
        {},
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        attn_implementation=attn,
    )


def _both(builder: Callable[[str], ModelAndArgs]) -> dict[str, Callable[[], ModelAndArgs]]:
    name = builder.__name__
    return {f"{name}_{attn}": partial(builder, attn) for attn in ("eager", "sdpa")}


def _eager(builder: Callable[[str], ModelAndArgs]) -> dict[str, Callable[[], ModelAndArgs]]:
    name = builder.__name__
    return {f"{name}_eager": lambda: builder("eager")}


HF_ZOO: dict[str, Callable[[], ModelAndArgs]] = {
    **_both(llama),
    **_both(mistral),
    **_both(qwen2),
    **_both(gemma),
    **_both(phi3),
    **_both(gpt2),
    **_both(bert),
    **_both(vit),
    **_both(clip_text),
    **_both(whisper_encoder),
    "convnext": convnext,
    "mobilevit": mobilevit,
    **_eager(mixtral),
    **_eager(qwen2moe),
    **_eager(qwen3),
    **_eager(gemma2),
    **_eager(starcoder2),
    **_eager(cohere),
    **_both(falcon),
    **_eager(t5),
    "swin": swin,
    **_eager(siglip_vision),
}
"""Every ``transformers`` zoo model by name, in a fixed order; each is callable with no argument."""

DECODER_LLMS: tuple[str, ...] = tuple(
    n
    for n in HF_ZOO
    if n.split("_")[0]
    in (
        "llama",
        "mistral",
        "qwen2",
        "gemma",
        "phi3",
        "gpt2",
        "mixtral",
        "qwen2moe",
        "qwen3",
        "gemma2",
        "starcoder2",
        "cohere",
        "falcon",
    )
)
"""The decoder-only language models of :data:`HF_ZOO`."""

GROUPED_KV: tuple[str, ...] = tuple(
    n for n in HF_ZOO if n.split("_")[0] in ("llama", "mistral", "qwen2", "gemma")
)
"""Models whose attention repeats K/V (``repeat_kv``) and must lose that repetition at iOS18."""

FAST: tuple[str, ...] = ("llama_sdpa", "gpt2_eager")
"""A few small models the default test run converts; ``make models`` converts them all."""

BOTH_PRECISIONS: tuple[str, ...] = tuple(
    n
    for n in HF_ZOO
    if n.split("_")[0]
    in ("mixtral", "qwen2moe", "qwen3", "gemma2", "starcoder2", "cohere", "falcon", "t5", "swin", "siglip")
)
"""Models converted at fp16 as well as fp32 by the slow tests and ``make models`` (the others at fp32)."""

ONLY_ATTENTION_LEFT: tuple[str, ...] = ("swin", "siglip_vision_eager")
"""Models that lose ops at iOS18 only. coremltools itself fuses their projections (``linear``), layer norms
and GELUs; what the override adds is their attention as one ``scaled_dot_product_attention``, an iOS18 op.
At iOS17 the override leaves them as coremltools converts them (the same op counts): decision, nothing
else in them has a MIL op or an exact identity with fewer ops (Swin's window partition and ``roll`` are
``reshape``/``transpose``/``gather`` layout, its patch merging ``slice_by_index`` + ``concat``)."""
