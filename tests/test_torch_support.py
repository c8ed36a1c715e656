"""``pattern_infra.torch_support``: converters for the PyTorch ops coremltools 9.0 rejects."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

from pattern_infra import torch_support
from pattern_infra.verification.evaluator import evaluate
from pattern_infra.testing.convert import convert_torch, op_counts


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


MODULES = {"alias": Alias, "where.scalarother": WhereScalarOther, "new_ones": AndOfNewOnes}


@pytest.fixture
def without_converters():
    """Remove our converters for the test, and put back whatever the registry held afterwards."""
    keys = [key for kind in torch_support.CONVERTERS for key in torch_support._keys(kind)]
    saved = {key: _TORCH_OPS_REGISTRY.name_to_func_mapping.pop(key, None) for key in keys}
    yield
    for key, func in saved.items():
        if func is None:
            _TORCH_OPS_REGISTRY.name_to_func_mapping.pop(key, None)
        else:
            _TORCH_OPS_REGISTRY.name_to_func_mapping[key] = func


def test_coremltools_lacks_them_and_install_adds_each_once(without_converters):
    assert torch_support.installed() == []
    with pytest.raises(NotImplementedError, match="Unsupported fx node alias"):
        convert_torch(Alias(), (torch.randn(2, 3),), override=False)
    assert torch_support.install() == list(torch_support.CONVERTERS)
    assert torch_support.installed() == list(torch_support.CONVERTERS)
    assert torch_support.install() == []  # idempotent


def test_a_converter_coremltools_already_has_is_kept(without_converters):
    def theirs(context, node):  # stands for a later coremltools' own converter
        raise AssertionError("not called")

    _TORCH_OPS_REGISTRY.name_to_func_mapping["alias"] = theirs
    assert "alias" not in torch_support.install()
    assert _TORCH_OPS_REGISTRY.name_to_func_mapping["alias"] is theirs


def test_import_installs_nothing():
    import subprocess
    import sys

    code = ("import pattern_infra, generic_passes;"
            "from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY as R;"
            "print('alias' in R.name_to_func_mapping)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("kind", list(MODULES))
def test_converted_module_computes_what_torch_computes(kind):
    torch_support.install()
    x = torch.tensor([[1.5, -2.0, 0.0], [-0.5, 3.0, -1.0]])
    module = MODULES[kind]()
    prog = convert_torch(module, (x,), override=False)
    (name,) = prog.functions["main"].inputs
    (got,) = evaluate(prog, {name: x.numpy()}).values()
    np.testing.assert_allclose(got, module(x).numpy(), rtol=1e-6, atol=0)
    assert sum(op_counts(prog).values()) > 0
