"""``pattern_infra.pytorch.torch_support``: converters for the PyTorch ops coremltools 9.0 rejects."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
import torch
from coremltools.converters.mil.frontend.torch import ops as ct_ops
from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

from pattern_infra.pytorch import torch_support
from pattern_infra.testing.convert import convert_exported, convert_torch, op_counts
from pattern_infra.verification.evaluator import evaluate


class Alias(torch.nn.Module):
    def forward(self, x):
        return torch.ops.aten.alias(x) * 2.0


class WhereScalarOther(torch.nn.Module):
    def forward(self, x):
        return torch.where(x > 0, x, -3.5)


class AndOfNewOnes(torch.nn.Module):
    def forward(self, x):
        keep = x.new_ones((), dtype=torch.bool) & (x > 0)
        return torch.where(keep, x, x * 0.25)


class IndexAdd(torch.nn.Module):
    """MoE routing's combine step: each (token, expert) output added to its token's row, tokens repeated."""

    def forward(self, x):
        token_idx = torch.tensor([0, 1, 0, 1, 0])
        return torch.zeros_like(x[:2]).index_add(0, token_idx, x[:5] * 0.5, alpha=2.0) + x[:2]


class IndexAddLastDim(torch.nn.Module):
    def forward(self, x):
        return x.index_add(-1, torch.tensor([2, 2]), x[:, :2])


class WhereScalarSelfFloatCond(torch.nn.Module):
    """The sliding-window mask written as Gemma2-style code writes it: ``tril`` of a bool tensor."""

    def forward(self, x):
        far = torch.tril(torch.ones_like(x, dtype=torch.bool), diagonal=-1)
        return torch.where(far, -7.0, x)


class GeluTanh(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x * 3.0, approximate="tanh")


class GeluTanhNextToATanh(torch.nn.Module):
    """Gemma2's soft-capping makes a node named ``tanh``: the string ``'tanh'`` must not be read as it."""

    def forward(self, x):
        return torch.tanh(x / 3.0) + torch.nn.functional.gelu(x * 3.0, approximate="tanh")


class ToDtype(torch.nn.Module):
    """``.to(dtype)``: torch 2.13 exports an ``_assert_tensor_metadata`` next to the copy."""

    def forward(self, x):
        return (x * 2).to(torch.float32) + 1.0


class SliceAssignments(torch.nn.Module):
    """``x[b:e] = y`` exports as ``copy`` into the slice: one of the same shape, one broadcast from a
    row, one cast from int32."""

    def forward(self, x):
        y = x * 2.0
        y[1:3] = x[3:5] + 1.0
        y[3:5] = x[0]
        y[0:1, 1:3] = (x[0:1, 0:2] * 4.0).to(torch.int32)
        return y - 0.5


def convert_as_is(module, args):
    """Export and convert with whatever converters the registry holds (``convert_torch`` installs ours)."""
    exported = torch.export.export(module.eval(), args).run_decompositions({})
    return convert_exported(exported, override=False)


MODULES = {
    "alias": Alias,
    "where.scalarother": WhereScalarOther,
    "new_ones": AndOfNewOnes,
    "index_add": IndexAdd,
    "index_add_last_dim": IndexAddLastDim,
    "where.scalarself": WhereScalarSelfFloatCond,
    "gelu": GeluTanh,
    "gelu_next_to_a_tanh": GeluTanhNextToATanh,
    "_assert_tensor_metadata": ToDtype,
    "copy": SliceAssignments,
}

COREMLTOOLS_OWN = {"where.scalarself": ct_ops.where_scalarself, "gelu": ct_ops.gelu, "copy": ct_ops.copy}
"""coremltools' own converters of the op kinds :data:`torch_support.REPLACEMENTS` replaces where wrong."""


@pytest.fixture
def without_converters():
    """Remove our converters for the test (coremltools' own back for the replaced kinds), and put back
    whatever the registry held afterwards."""
    keys = [
        key
        for kind in [*torch_support.CONVERTERS, *torch_support.REPLACEMENTS]
        for key in torch_support._keys(kind)
    ]
    saved = {key: _TORCH_OPS_REGISTRY.name_to_func_mapping.pop(key, None) for key in keys}
    for kind, func in COREMLTOOLS_OWN.items():
        for key in torch_support._keys(kind):
            _TORCH_OPS_REGISTRY.name_to_func_mapping[key] = func
    yield
    for key, func in saved.items():
        if func is None:
            _TORCH_OPS_REGISTRY.name_to_func_mapping.pop(key, None)
        else:
            _TORCH_OPS_REGISTRY.name_to_func_mapping[key] = func


def test_coremltools_lacks_them_and_install_adds_each_once(without_converters):
    assert torch_support.installed() == []
    # coremltools 9.0 raises NotImplementedError for an unsupported node, 8.3 a ValueError
    with pytest.raises((NotImplementedError, ValueError), match="Unsupported fx node alias"):
        convert_as_is(Alias(), (torch.randn(2, 3),))
    expected = [*torch_support.CONVERTERS, *torch_support.REPLACEMENTS]
    assert torch_support.install() == expected
    assert torch_support.installed() == expected
    assert torch_support.install() == []  # idempotent


@pytest.mark.parametrize("kind", list(torch_support.REPLACEMENTS))
def test_a_replacement_passes_its_probe_and_a_wrong_converter_fails_it(kind):
    ours, right = torch_support.REPLACEMENTS[kind]
    assert right(ours)

    def wrong(context, node):  # what coremltools 9.0 does: the exact gelu, the condition as it comes
        from coremltools.converters.mil import Builder as mb

        inputs = ct_ops._get_inputs(context, node)
        out = mb.gelu(x=inputs[0]) if kind == "gelu" else mb.select(cond=inputs[0], a=inputs[1], b=inputs[2])
        context.add(out, torch_name=node.name)

    # coremltools 9.0's copy: src's shape where the set of the two symbols lists src's first
    assert not right(ct_ops.copy if kind == "copy" else wrong)


@pytest.mark.parametrize("kind", list(torch_support.REPLACEMENTS))
def test_a_converter_that_passes_the_probe_is_kept(without_converters, kind):
    def theirs(context, node):  # stands for a later coremltools' fixed converter
        torch_support.REPLACEMENTS[kind][0](context, node)

    for key in torch_support._keys(kind):
        _TORCH_OPS_REGISTRY.name_to_func_mapping[key] = theirs
    assert kind not in torch_support.install()
    assert _TORCH_OPS_REGISTRY.name_to_func_mapping[kind] is theirs


def test_without_the_gelu_replacement_the_tanh_gelu_is_not_what_torch_computes(without_converters):
    """The case the gelu replacement exists for, seen through coremltools' own converter when it is wrong."""
    if torch_support.REPLACEMENTS["gelu"][1](ct_ops.gelu):
        pytest.skip("this coremltools converts approximate='tanh' itself")
    x = torch.linspace(-3, 3, 12).reshape(3, 4)
    prog = convert_as_is(GeluTanh(), (x,))
    (name,) = prog.functions["main"].inputs
    (got,) = evaluate(prog, {name: x.numpy()}).values()
    assert np.max(np.abs(got - GeluTanh()(x).numpy())) > 1e-4


def test_a_converter_coremltools_already_has_is_kept(without_converters):
    def theirs(context, node):  # stands for a later coremltools' own converter
        raise AssertionError("not called")

    _TORCH_OPS_REGISTRY.name_to_func_mapping["alias"] = theirs
    assert "alias" not in torch_support.install()
    assert _TORCH_OPS_REGISTRY.name_to_func_mapping["alias"] is theirs


def test_import_installs_nothing():
    import forked

    code = (
        "import pattern_infra, generic_passes;"
        "from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY as R;"
        "print('alias' in R.name_to_func_mapping)"
    )
    out = forked.run(["-c", code])  # a fresh interpreter (tests/forked.py)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("kind", list(MODULES))
def test_converted_module_computes_what_torch_computes(without_converters, kind):
    torch_support.install()  # ours, whatever this coremltools has
    x = torch.tensor(
        [[1.5, -2.0, 0.0], [-0.5, 3.0, -1.0], [0.25, 1.0, -1.5], [2.0, -0.75, 0.5], [-1.25, 0.5, 1.0]]
    )
    module = MODULES[kind]()
    prog = convert_torch(module, (x,), override=False)
    (name,) = prog.functions["main"].inputs
    (got,) = evaluate(prog, {name: x.numpy()}).values()
    np.testing.assert_allclose(got, module(x).numpy(), rtol=1e-6, atol=1e-7)
    assert sum(op_counts(prog).values()) > 0


class CacheUpdate(torch.nn.Module):
    """A KV-cache update as Apple's iOS 18 guide writes it: ``L`` new rows written at ``[S - L, S)`` of the
    cache, read back up to ``S`` (``S`` from the mask's last axis; a cache of ones, not state).

    Args:
        one_row: Write the first new row into all ``L`` rows (PyTorch broadcasts it to the slice).
    """

    def __init__(self, one_row: bool = False):
        super().__init__()
        self.one_row = one_row

    def forward(self, x, mask):
        end = mask.shape[-1]
        begin = end - x.shape[1]
        cache = torch.ones(1, 16, 4)
        cache[:, begin:end] = (x[:, :1] if self.one_row else x) * 2.0
        return cache[:, :end].sum(dim=1, keepdim=True) + mask.sum()


RUN_TIME_SLICE_END = pytest.mark.skipif(
    int(ct.__version__.split(".")[0]) < 9,
    reason="coremltools 8's slice converter cannot convert a slice whose end is computed at run time",
)


@RUN_TIME_SLICE_END
@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one_row"])
def test_a_flexible_cache_update_writes_the_rows_as_they_are(one_row):
    """``torch.export`` proves the slice ``[S - L, S)`` ``L`` long under its guard ``S >= L`` (the exported
    program rejects ``S < L``): no ``tile`` of the new rows (one row is tiled to the slice's length, read
    at run time), and the program computes what PyTorch does."""
    torch_support.install()
    module = CacheUpdate(one_row)
    query, cache = (torch.export.Dim(name, min=1, max=15) for name in ("query", "cache"))
    args = (torch.ones(1, 2, 4), torch.zeros(1, 5))
    exported = torch.export.export(module, args, dynamic_shapes={"x": {1: query}, "mask": {1: cache}})
    with pytest.raises(AssertionError, match="Guard failed"):
        exported.module()(torch.ones(1, 3, 4), torch.zeros(1, 2))
    prog = convert_exported(exported.run_decompositions({}), override=False)
    assert op_counts(prog).get("tile", 0) == int(one_row)
    rng = np.random.default_rng(0)
    for length, end in [(1, 1), (3, 5), (4, 15), (1, 15)]:
        x, mask = rng.standard_normal((1, length, 4)), rng.standard_normal((1, end))
        want = module(torch.from_numpy(x).float(), torch.from_numpy(mask).float()).numpy()
        (got,) = evaluate(prog, {"x": x, "mask": mask}).values()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
