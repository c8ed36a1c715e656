"""Real PyTorch models converted with the override off and on (issue: generic_passes, real models).

With the override on, the op count is never higher, it is lower wherever a pass beyond coremltools
applies, and both programs compute what PyTorch computes (reference evaluator in float64 against torch's
float32 output: errors are float32 rounding, so the bound is relative to the output scale).
"""

from __future__ import annotations

import pytest

from pattern_infra.testing.models import ZOO
from pattern_infra.testing.real_models import compare_model, compare_targets

# models where a fusion beyond coremltools applies: the op that must appear (None: ops only go away)
# and the pass that must fire
BEYOND = {
    "gpt2_block": (None, "generic::fuse_reshape_linear_reshape"),
    "prenorm_transformer": ("layer_norm", "common::fuse_layernorm_or_instancenorm"),
    "prenorm_transformer_inline_ln": ("layer_norm", "common::fuse_layernorm_or_instancenorm"),
    "convnext_stage": ("layer_norm", "common::fuse_layernorm_or_instancenorm"),
    "clip_mlp": ("gelu", "common::fuse_gelu_exact"),
    "jax_style_gelu_mlp": ("gelu", "common::fuse_gelu_tanh_approximation"),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_model_with_and_without_override(name):
    row = compare_model(name)
    assert row.total_on <= row.total_off, (row.ops_off, row.ops_on)
    if name in BEYOND:
        op_type, pass_id = BEYOND[name]
        assert row.total_on < row.total_off
        assert op_type is None or row.ops_on[op_type] > row.ops_off[op_type]
        assert row.fired.get(pass_id, 0) > 0, row.fired
    tolerance = 1e-5 * max(1.0, row.scale)
    assert row.max_abs_err_off < tolerance
    assert row.max_abs_err_on < tolerance


def test_compare_targets_refuses_an_unknown_precision():
    with pytest.raises(ValueError, match=r"unknown precisions \['bf16'\]"):
        compare_targets("mlp", [], precisions=("fp32", "bf16"))
