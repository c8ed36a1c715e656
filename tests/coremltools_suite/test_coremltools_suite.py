"""coremltools' own tests of the passes that ``generic_passes`` replaces, run against our passes.

coremltools ships the tests of its graph passes inside the installed package. This module imports the
test classes that exercise the replaced passes; pytest collects an imported ``Test*`` class like one
defined here. ``conftest.py`` next to this file then:

1. keeps only the tests named in :data:`PASS_TESTS` and deselects the other tests of those classes;
2. skips, with the reason ``not yet generic``, the tests of a pass id that is not a ``PassContainer``;
3. runs every other test with ``import generic_passes`` done and ``ENABLE_EXPERIMENTAL_PASSES=1`` set,
   and fails a test that passed without running each of its passes through a ``PassContainer``;
4. prints passed / failed / skipped counts per pass id at the end.

Node ids are ``tests/coremltools_suite/test_coremltools_suite.py::<Class>::<test>[<params>]``; class and
test names are coremltools' own, so ``<Class>::<test>`` finds the test in coremltools' sources.

``TestFuseLinearBias`` and ``TestFuseMatmulWeightBias`` exist twice in coremltools 9.0, identical, in
``test_passes.py`` and ``test_optimize_linear_passes.py``; the second copy is the one run here.
``test_cleanup_passes.py`` imports the ``mock`` package; ``conftest.py`` lets ``unittest.mock`` stand in
for it when it is not installed, and says so in the summary.
"""

from __future__ import annotations

from coremltools.converters.mil.backend.mil.passes.test_passes import (  # noqa: F401  (collected)
    TestPassFuseActivationSiLU,
    TestPassFusePow2Sqrt,
)
from coremltools.converters.mil.mil.passes.tests.test_cleanup_passes import (  # noqa: F401
    TestConstElimination,
    TestDeadCodeElimination,
    TestReduceMeanFusion,
    TestTopologicalReorder,
)
from coremltools.converters.mil.mil.passes.tests.test_optimize_linear_passes import (  # noqa: F401
    TestFuseLinearBias,
    TestFuseMatmulWeightBias,
    TestFuseTransposeMatmul,
)
from coremltools.converters.mil.mil.passes.tests.test_passes import (  # noqa: F401
    TestConv1dChannellastCompositionPasses,
    TestConv1dCompositionPasses,
    TestConvBatchNormFusion,
    TestConvBiasFusion,
    TestConvScaleFusion,
    TestFuseElementwiseToBatchNorm,
    TestFuseLayerNormOrInstanceNorm,
    TestFuseOnehotMatmulToGather,
    TestFusePadConv,
    TestFuseSqueezeExpandDims,
    TestGeluFusion,
    TestGraphPassScopePreservation,
    TestLeakyReluFusion,
    TestMergeConsecutiveRelus,
    TestPreluFusion,
    TestPreluToLrelu,
    TestSkipConstexprOps,
)
from coremltools.converters.mil.mil.passes.tests.test_reduce_transposes_pass import (  # noqa: F401
    TransposeOptimizationPass,
)

PASS_TESTS: dict[str, tuple[str, ...]] = {
    "common::fuse_gelu_tanh_approximation": (
        "TestGeluFusion::test_gelu_tanh_approximation1",
        "TestGeluFusion::test_gelu_tanh_approximation2",
        "TestGeluFusion::test_gelu_tanh_multiple_final_operations",
    ),
    "common::fuse_gelu_exact": (
        "TestGeluFusion::test_gelu_exact",
        "TestGeluFusion::test_gelu_exact_pattern_2",
    ),
    "common::fuse_leaky_relu": ("TestLeakyReluFusion",),
    "common::fuse_prelu": ("TestPreluFusion",),
    "common::prelu_to_lrelu": ("TestPreluToLrelu",),
    "common::fuse_linear_bias": (
        "TestFuseLinearBias",
        "TestSkipConstexprOps::test_skip_fuse_linear_bias",
    ),
    "common::fuse_matmul_weight_bias": (
        "TestFuseMatmulWeightBias",
        "TestSkipConstexprOps::test_skip_fuse_matmul_weight_bias",
    ),
    "common::fuse_transpose_matmul": ("TestFuseTransposeMatmul",),
    "common::fuse_conv_bias": (
        "TestConvBiasFusion",
        "TestConv1dCompositionPasses::test_conv1d_bias_fusion",
        "TestConv1dChannellastCompositionPasses::test_conv1d_channellast_bias_fusion",
        "TestSkipConstexprOps::test_skip_fuse_conv",
    ),
    "common::fuse_conv_scale": (
        "TestConvScaleFusion",
        "TestSkipConstexprOps::test_skip_fuse_conv",
    ),
    "common::fuse_conv_batchnorm": (
        "TestConvBatchNormFusion",
        "TestSkipConstexprOps::test_skip_fuse_conv_batchnorm",
    ),
    "common::fuse_pad_conv": ("TestFusePadConv",),
    "common::fuse_layernorm_or_instancenorm": (
        "TestFuseLayerNormOrInstanceNorm",
        "TestGraphPassScopePreservation::test_multiple_passes",
    ),
    "common::fuse_elementwise_to_batchnorm": ("TestFuseElementwiseToBatchNorm",),
    "common::fuse_reduce_mean": ("TestReduceMeanFusion",),
    "common::merge_consecutive_relus": (
        "TestMergeConsecutiveRelus",
        "TestGraphPassScopePreservation::test_single_pass_without_creating_new_var",
    ),
    "common::fuse_squeeze_expand_dims": ("TestFuseSqueezeExpandDims",),
    "common::fuse_onehot_matmul_to_gather": ("TestFuseOnehotMatmulToGather",),
    "common::topological_reorder": ("TestTopologicalReorder",),
    "common::const_elimination": ("TestConstElimination",),
    "common::dead_code_elimination": ("TestDeadCodeElimination",),
    "common::reduce_transposes": ("TransposeOptimizationPass",),
    "mil_backend::fuse_activation_silu": ("TestPassFuseActivationSiLU",),
    "mil_backend::fuse_pow2_sqrt": ("TestPassFusePow2Sqrt",),
}
"""Pass id -> the coremltools tests that apply it: ``"<Class>"`` (every test of the class) or
``"<Class>::<test>"`` (every parametrization of one test). A test listed under two ids applies both.

Found by grepping coremltools' test modules for each pass id (and for the helpers that apply it, such as
``_apply_weight_transform``). Left out on purpose: ``test_pass_pipeline.py`` only edits pipeline lists
that name ``common::merge_consecutive_relus`` and never runs it; the frontend tests that mention these
passes convert whole torch or TensorFlow models and need macOS.
"""


EXPECTED_DIFFERENCES: dict[str, str] = {
    "TestSkipConstexprOps::test_skip_fuse_conv[constexpr_affine_dequantize-mul-True-False]": (
        "wider: compressed weights are weights; ours folds the scale into the int8 weight's per-axis "
        "scale (a new constexpr_affine_dequantize, never decompressed); coremltools leaves the mul"
    ),
    "TestSkipConstexprOps::test_skip_fuse_conv_batchnorm[constexpr_affine_dequantize-True-False]": (
        "wider: as test_skip_fuse_conv, the batch_norm's factors go into the int8 weight's per-axis scale"
    ),
    "TestSkipConstexprOps::test_skip_fuse_linear_bias[constexpr_cast-True-False]": (
        "wider: a constant bias folds into a linear whatever its weight; the constexpr_cast "
        "weight is kept as it is"
    ),
    "TestSkipConstexprOps::test_skip_fuse_linear_bias[constexpr_sparse_to_dense-True-False]": (
        "wider: a constant bias folds into a linear whatever its weight; the constexpr_sparse_to_dense "
        "weight is kept as it is"
    ),
    "TestSkipConstexprOps::test_skip_fuse_linear_bias[constexpr_lut_to_dense-True-False]": (
        "wider: a constant bias folds into a linear whatever its weight; the constexpr_lut_to_dense "
        "weight is kept as it is"
    ),
    "TestSkipConstexprOps::test_skip_fuse_linear_bias[constexpr_affine_dequantize-True-False]": (
        "wider: a constant bias folds into a linear whatever its weight; the constexpr_affine_dequantize "
        "weight is kept as it is"
    ),
    "TestFuseLayerNormOrInstanceNorm::test_ane_layer_norm[True-True]": (
        "wider: coremltools refuses the whole fusion when beta is constexpr; ours fuses the norm into "
        "layer_norm and leaves the constexpr beta add and the gamma mul as ops (nothing constexpr is folded)"
    ),
    "TestFuseLayerNormOrInstanceNorm::test_ane_layer_norm_intermediate_var_reuse[True-x8]": (
        "wider: an affine intermediate is reused outside, so coremltools refuses everything; ours fuses "
        "the norm itself (whose output may be used anywhere) and keeps the reused affine ops"
    ),
    "TestFuseLayerNormOrInstanceNorm::test_ane_layer_norm_intermediate_var_reuse[True-x9]": (
        "wider: as [True-x8], with beta also absorbed where it is private to the match"
    ),
    "TestFuseLayerNormOrInstanceNorm::test_ane_layer_norm_ambiguous_add": (
        "wider: the program is exactly layer_norm with beta; coremltools declines an add it calls ambiguous"
    ),
    "TestFuseLayerNormOrInstanceNorm::test_instance_norm_pattern_4": (
        "correctness: the test's scales (3.3e-5, 8.3e-6) are not 1/N, so coremltools' fusion changes the "
        "values; ours refuses it"
    ),
    "TestConstElimination::test_const_elimination_larger_than_threshold": (
        "fails against coremltools' own pass too (without generic_passes): the test patches "
        "'...defs.cleanup.const_elimination._skip_const_by_size', which mock resolves to the module "
        "const_elimination.py, not the class, so it errors before running; skip_const_by_size is "
        "tested through the pipeline in tests/test_cleanup_passes.py"
    ),
    "TestGeluFusion::test_gelu_tanh_multiple_final_operations": (
        "same program, no warning: the test expects coremltools' own generic matcher to warn 'matched to "
        "more than one final operation'; ours matches correctly and has nothing to warn about"
    ),
}
"""coremltools tests whose assertion our passes do not meet on purpose, with the reason (strict xfail:
if one starts passing, the run fails and the entry must go)."""
