"""The ``transformers`` zoo converted with the override off and on, at iOS17 and iOS18.

Every model: never more ops with the override, both programs within 1e-5 of PyTorch relative to the
output scale (reference evaluator in float64 against torch's float32). Decoder-only LLMs: fewer ops at
both targets. Grouped-KV models at iOS18: RMSNorm fused and K/V never repeated (no ``tile``), attention
one ``scaled_dot_product_attention``. The fast subset (:data:`FAST`) runs by default; the rest is marked
slow and runs under ``make models`` (``pytest --run-slow``).
"""

from __future__ import annotations

import functools

import coremltools as ct
import pytest

from pattern_infra.testing.hf_models import (
    BOTH_PRECISIONS,
    DECODER_LLMS,
    FAST,
    GROUPED_KV,
    HF_ZOO,
    ONLY_ATTENTION_LEFT,
)
from pattern_infra.testing.real_models import PRECISIONS, ModelComparison, compare_targets

TARGETS = (ct.target.iOS17, ct.target.iOS18)
REL_TOL = 1e-5


@functools.cache
def _all_rows(name: str) -> tuple[ModelComparison, ...]:
    return tuple(
        compare_targets(name, TARGETS, precisions=PRECISIONS if name in BOTH_PRECISIONS else ("fp32",))
    )


def _rows(name: str) -> dict[object, ModelComparison]:
    """The fp32 comparison at each target."""
    return {row.target: row for row in _all_rows(name) if row.precision == "fp32"}


def _params() -> list:
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in HF_ZOO]


@pytest.mark.parametrize("name", _params())
def test_never_more_ops_and_same_numbers(name):
    for target, row in _rows(name).items():
        assert row.total_on <= row.total_off, (target, row.changed())
        assert row.rel_err_off < REL_TOL, (target, row.rel_err_off)
        assert row.rel_err_on < REL_TOL, (target, row.rel_err_on)


@pytest.mark.parametrize("name", [n for n in _params() if n.values[0] in DECODER_LLMS])
def test_decoder_llms_lose_ops(name):
    for target, row in _rows(name).items():
        assert row.total_on < row.total_off, (target, row.changed())


@pytest.mark.parametrize("name", [n for n in _params() if n.values[0] in BOTH_PRECISIONS])
def test_fewer_ops_at_both_precisions_and_fp16_no_worse(name):
    """Every model converted at fp16 too loses ops there (at iOS18 only for :data:`ONLY_ATTENTION_LEFT`,
    never gains any), and its fp16 program (run in fp16) is no further from PyTorch with the override than
    without, beyond fp16's own rounding (2**-10 of the output scale)."""
    for row in _all_rows(name):
        assert row.total_on <= row.total_off, (row.target, row.precision, row.changed())
        if row.target == ct.target.iOS18 or name not in ONLY_ATTENTION_LEFT:
            assert row.total_on < row.total_off, (row.target, row.precision, row.changed())
        if row.precision == "fp16":
            assert row.rel_err_on <= row.rel_err_off + 2.0**-10, (row.target, row.rel_err_off, row.rel_err_on)


@pytest.mark.parametrize("name", BOTH_PRECISIONS)
def test_builder_runs_in_torch_without_downloading(name):
    """Cheap check of each entry in the default run: the config builds offline and the model computes."""
    model, args = HF_ZOO[name]()
    out = model(*args)
    assert out.ndim == 3 and out.shape[0] == 1 and bool(out.isfinite().all())


@pytest.mark.parametrize("name", [n for n in _params() if n.values[0] in GROUPED_KV])
def test_rmsnorm_and_grouped_kv_attention_fused_at_ios18(name):
    row = _rows(name)[ct.target.iOS18]
    assert row.fired.get("generic::fuse_rms_norm", 0) == 5, row.fired  # 2 layers x 2 + the final norm
    assert row.fired.get("generic::fuse_grouped_kv_attention", 0) == 2, row.fired  # one per layer
    assert row.ops_off["tile"] > 0 and row.ops_on["tile"] == 0, row.changed()
    assert row.ops_on["scaled_dot_product_attention"] == 2, row.changed()
    assert row.ops_on["rsqrt"] == 0 and row.ops_on["reduce_mean"] == 0, row.changed()
