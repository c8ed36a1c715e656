"""explain_in_conversion: the program a pass sees inside coremltools.convert, not the converted model."""

from __future__ import annotations

import pytest
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from pattern_infra import (
    PassRegistrationError,
    PatternInfraError,
    explain,
    explain_in_conversion,
    program_before,
)

torch = pytest.importorskip("torch")

from pattern_infra.testing import models  # noqa: E402  (imports torch)
from pattern_infra.testing.convert import convert_torch  # noqa: E402

AT = "common::fuse_gelu_exact"


@pytest.fixture(scope="module")
def erf_mlp():
    """A linear layer and BERT's erf GELU, which coremltools' own pass fuses during the conversion."""

    class ErfMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return models.gelu_erf(self.fc(x))

    torch.manual_seed(0)
    module = ErfMLP().eval()
    args = (torch.randn(2, 8),)
    return module, args, torch.export.export(module, args).run_decompositions({})


def test_the_converted_model_hides_what_the_pass_saw(erf_mlp):
    module, args, exported = erf_mlp
    converted = convert_torch(module, args, override=False)  # coremltools' pass fused the GELU
    assert explain(AT, converted).matches == []
    inside = explain_in_conversion(exported, at=AT, override_passes=False)
    assert len(inside.matches) == 1
    (match,) = inside.matches
    assert sorted(op.op_type for op in match.op_set) == [
        "add",
        "erf",
        "mul",
        "mul",
        "mul",
    ]  # / sqrt(2): a mul by then
    assert PASS_REGISTRY.passes[AT].__class__.__name__ == "PassContainer"  # the stand-in is gone


def test_program_before_is_a_copy_taken_before_the_pass(erf_mlp):
    _, _, exported = erf_mlp
    prog = program_before(exported, AT, override_passes=True)
    types = [op.op_type for op in prog.functions["main"].operations]
    assert "erf" in types and "gelu" not in types


def test_a_pattern_can_be_given_instead_of_the_pass(erf_mlp):
    _, _, exported = erf_mlp
    from generic_passes.fuse_gelu_exact import GELU_EXACT_PATTERNS

    result = explain_in_conversion(exported, GELU_EXACT_PATTERNS, at=AT, override_passes=False)
    assert len(result.matches) == 1


def test_unknown_pass_id_names_the_nearest(erf_mlp):
    _, _, exported = erf_mlp
    with pytest.raises(PassRegistrationError, match="Did you mean common::fuse_gelu_exact"):
        explain_in_conversion(exported, at="common::fuse_gelu_exakt")
    with pytest.raises(PassRegistrationError, match="at='namespace::pass'"):
        explain_in_conversion(exported)


def test_a_pass_the_pipeline_does_not_run_is_reported(erf_mlp):
    _, _, exported = erf_mlp
    with pytest.raises(PatternInfraError, match="never ran 'common::fuse_gelu_exact'"):
        explain_in_conversion(exported, at=AT, convert_kwargs={"pass_pipeline": PassPipeline.EMPTY})
