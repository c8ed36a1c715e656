"""``generic_passes._shape_proof``: symbolic dimensions proven from shape ops and declared ranges."""

from __future__ import annotations

import coremltools as ct
import sympy as sp
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from generic_passes._shape_proof import ShapeFacts
from pattern_infra.testing.cached_attention import cached_attention, declare_ranges


def _op(prog, name):
    (op,) = [op for op in prog.functions["main"].operations if op.outputs[0].name == name]
    return op


def _facts(prog):
    return ShapeFacts.of(prog.functions["main"])


def test_cache_slice_tile_and_reshape_resolve_to_the_mask_length():
    prog = cached_attention()
    facts = _facts(prog)
    mask = prog.functions["main"].inputs["mask"]
    length, cache_len = mask.shape[2], mask.shape[3]
    assert facts.dim(_op(prog, "k_slice").outputs[0], 2) == cache_len
    assert facts.values(_op(prog, "k_tile").reps) == (1, 1, 2, 1, 1)
    assert facts.dims(_op(prog, "k_repeated").outputs[0]) == (1, 4, cache_len, 8)
    assert length != cache_len  # two inputs' symbols: never taken for one another


def test_without_declared_range_the_slice_may_clamp():
    prog = cached_attention(bounded=False)
    facts = _facts(prog)
    sliced = _op(prog, "k_slice").outputs[0]
    assert facts.dim(sliced, 2) == sp.sympify(sliced.shape[2])  # unknown: S <= 16 is not proven
    reps = facts.values(_op(prog, "k_tile").reps)
    assert reps is None  # S / (unknown slice length) is not proven an exact integer division


def test_comparisons_use_the_declared_ranges():
    n, m = get_new_symbol(), get_new_symbol()

    @mb.program(input_specs=[mb.TensorSpec(shape=(n, m))], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.relu(x=x)

    declare_ranges(prog, {str(n): (1, 15)})
    facts = _facts(prog)
    assert facts.le(n, 15) and facts.le(n, 16) and not facts.le(n, 14)
    assert facts.le(0, m) and not facts.le(m, 100)  # undeclared: a size, >= 0, unbounded
    assert facts.decide_equal(n, -1) is False and facts.decide_equal(n, n) is True
    assert facts.decide_equal(n, m) is None
