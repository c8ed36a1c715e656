"""pattern_infra.pipeline(): the same program as the pass-by-pass default pipeline, in fewer entries."""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from coremltools.converters.mil.mil.scope import ScopeSource

import generic_passes  # noqa: F401  registers the project's passes
from bench.llm_workloads import llama_decoder, synthetic_mix
from generic_passes import CLEANUP_PASSES
from pattern_infra import GenericSweep, PassContainer, PassRegistrationError, evaluate, pipeline, run_log
from pattern_infra.rewriting.blocks import walk_blocks
from pattern_infra.testing.models import ZOO
from pattern_infra.testing.pipelines import converted, program_signature

GROUPS = ("all", "generic")


def expanded(pipe: PassPipeline) -> list[str]:
    """The pipeline's pass ids with every sweep replaced by the passes it runs."""
    ids: list[str] = []
    for pass_id in pipe.passes:
        entry = PASS_REGISTRY.passes[pass_id]
        ids += list(entry.pass_ids) if isinstance(entry, GenericSweep) else [pass_id]
    return ids


@pytest.mark.parametrize("group", GROUPS)
def test_pipeline_runs_the_default_passes_in_order_in_fewer_entries(group):
    default = PassPipeline.DEFAULT
    pipe = pipeline(group=group)
    assert expanded(pipe) == default.passes
    assert pipe.pipeline_name == "pattern_infra"
    is_generic = [isinstance(PASS_REGISTRY.passes[p], PassContainer) for p in default.passes]
    fusions = [p for p, g in zip(default.passes, is_generic) if g and p not in CLEANUP_PASSES]
    assert len(fusions) == 22
    sweeps = [p for p in pipe.passes if isinstance(PASS_REGISTRY.passes[p], GenericSweep)]
    standalone = [p for p in pipe.passes if isinstance(PASS_REGISTRY.passes[p], PassContainer)]
    assert sweeps
    # a generic pass convert looks up by id keeps its own (first) entry
    assert set(standalone) == {"common::const_elimination", "common::dead_code_elimination"}
    if group == "generic":  # runs of consecutive generic passes, coremltools' passes untouched
        assert [
            p for p in pipe.passes if not isinstance(PASS_REGISTRY.passes[p], (GenericSweep, PassContainer))
        ] == [p for p, g in zip(default.passes, is_generic) if not g]
    else:
        assert len(pipe.passes) < 20
    # what convert edits or looks up by id keeps its own entries
    # (coremltools 9.0's default pipeline has add_int16_cast twice, 8.3's once)
    assert pipe.passes.count("common::add_int16_cast") == default.passes.count("common::add_int16_cast") >= 1
    assert pipe.passes.count("common::add_fp16_cast") == 1
    for name in ("frontend_pytorch", "backend_mlprogram"):
        shared = set(PassPipeline.get_pipeline(name).passes) & set(default.passes)
        assert shared <= set(pipe.passes)


def test_pipeline_refuses_what_it_cannot_keep():
    with pytest.raises(PassRegistrationError, match="group must be"):
        pipeline(group="some")
    base = PassPipeline.DEFAULT
    base.set_options("common::fuse_gelu_exact", {"anything": "1"})
    with pytest.raises(PassRegistrationError, match="fuse_gelu_exact"):
        pipeline(base)


def test_options_of_grouped_coremltools_passes_are_passed_on():
    base = PassPipeline.DEFAULT
    base.set_options("common::const_elimination", {"skip_const_by_size": "1e9"})
    pipe = pipeline(base)
    sweeps = [
        PASS_REGISTRY.passes[p] for p in pipe.passes if isinstance(PASS_REGISTRY.passes[p], GenericSweep)
    ]
    assert any(s.options.get("common::const_elimination") for s in sweeps)
    assert pipe.get_options("common::const_elimination")[0].option_val == "1e9"  # its own entry too
    # with the option passed on inside the sweep, the same program as the base pipeline gives
    assert (
        program_signature(converted(lambda: synthetic_mix(60), lambda: pipeline(base_with_skip())))[0]
        == program_signature(converted(lambda: synthetic_mix(60), base_with_skip))[0]
    )


def base_with_skip() -> PassPipeline:
    base = PassPipeline.DEFAULT
    base.set_options("common::const_elimination", {"skip_const_by_size": "1e9"})
    return base


def _outputs(prog, seed=0):
    main = prog.functions["main"]
    rng = np.random.default_rng(seed)
    inputs = {name: rng.normal(size=var.shape).astype(np.float32) for name, var in main.inputs.items()}
    return evaluate(prog, inputs)


def _assert_same_conversion(source, group, **options):
    by_pass = converted(source, **options)
    swept = converted(source, lambda: pipeline(group=group), **options)
    expected, actual = program_signature(by_pass), program_signature(swept)
    assert actual[0] == expected[0]  # same printed program (ops, names, attributes, constants shown)
    assert actual[1] == expected[1]  # same op names, types and scopes, in order
    for a, b in zip(_outputs(by_pass).values(), _outputs(swept).values(), strict=True):
        np.testing.assert_array_equal(a, b)
    return swept


def _fused_with_pass_scope(prog) -> set[str]:
    """Generic passes named in the graph-pass scopes of the program's ops."""
    return {
        name
        for block, _ in walk_blocks(prog)
        for op in block.operations
        for name in op.scopes.get(ScopeSource.COREMLTOOLS_GRAPH_PASS, [])
    }


@pytest.mark.parametrize("group", GROUPS)
def test_same_program_as_pass_by_pass_on_the_mix(group):
    run_log(clear=True)
    prog = _assert_same_conversion(lambda: synthetic_mix(120), group)
    types = [op.op_type for op in prog.functions["main"].operations]
    assert {"layer_norm", "gelu", "linear", "conv"} <= set(types)
    assert "batch_norm" not in types
    # the sweep gave each rewrite its own pass's scope, and each pass its run_log entry
    assert {"fuse_layernorm_or_instancenorm", "fuse_gelu_tanh_approximation"} <= _fused_with_pass_scope(prog)
    fired = {pass_id for pass_id, _, stats in run_log() if stats.rewrites}
    assert "common::fuse_conv_batchnorm" in fired


@pytest.mark.parametrize("group", GROUPS)
def test_same_program_as_pass_by_pass_on_the_llama_decoder(group):
    _assert_same_conversion(lambda: llama_decoder(2, heads=2), group, compute_precision=ct.precision.FLOAT32)


def _torch_source(name):
    import torch

    def source():
        module, args = ZOO[name]()
        return torch.export.export(module.eval(), tuple(args)).run_decompositions({})

    return source


@pytest.mark.parametrize("name", list(ZOO))
def test_same_program_as_pass_by_pass_on_the_zoo(name):
    _assert_same_conversion(
        _torch_source(name),
        "all",
        compute_precision=ct.precision.FLOAT32,
        minimum_deployment_target=ct.target.iOS18,  # fuse_sdpa, a run_after follower, joins in
    )


def test_the_sweeps_run_generic_passes_whatever_the_variable_says():
    off = converted(lambda: synthetic_mix(60), override=False)
    swept = converted(lambda: synthetic_mix(60), pipeline, override=False)
    on = converted(lambda: synthetic_mix(60), override=True)
    assert program_signature(swept) == program_signature(on)
    assert "layer_norm" not in [op.op_type for op in off.functions["main"].operations]  # coremltools' own
