"""``generic::hoist_reshape_above_slices``: the same movement op after every single-index slice of a tensor,
done once before the slices; and the small torchvision ViT converted end to end against PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from generic_passes.hoist_reshape_above_slices import single_index
from pattern_infra.testing.passes import check_new_pass, op_types

PASS = "generic::hoist_reshape_above_slices"


def check(prog: Program, expected: list[str]) -> Program:
    """Runs the pass; demands op types ``expected`` and outputs equal to the element (movement is exact)."""
    return check_new_pass(PASS, prog, expected, rtol=0.0, atol=0.0)


def sliced(
    shape=(3, 17, 1, 64),
    follow=("reshape", (17, 4, 16)),
    *,
    n=3,
    axis=0,
    squeeze=True,
    extra=None,
    dtype=types.fp32,
    odd=None,
) -> Program:
    """``x`` cut into ``n`` single indices on ``axis``, each followed by ``follow``; ``odd``: another op
    after the last slice; ``extra``: x or a slice also used elsewhere."""
    rank = len(shape)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=dtype)])
    def prog(x):
        outs = []
        for i in range(n):
            begin = [0] * rank
            begin[axis] = i
            end = list(shape)
            end[axis] = i + 1
            mask = [False] * rank
            mask[axis] = squeeze
            s = mb.slice_by_index(x=x, begin=begin, end=end, squeeze_mask=mask, name=f"slice_{i}")
            kind, arg = odd if odd is not None and i == n - 1 else follow
            key = {"reshape": "shape", "transpose": "perm"}[kind]
            outs.append(getattr(mb, kind)(x=s, name=f"move_{i}", **{key: list(arg)}))
            if extra == "use_slice" and i == 0:
                outs.append(mb.exp(x=s, name="other"))
        if extra == "use_x":
            outs.append(mb.exp(x=x, name="other"))
        return tuple(outs)

    return prog


@pytest.mark.parametrize("dtype", [types.fp32, types.fp16], ids=["fp32", "fp16"])
def test_qkv_head_split_hoisted(dtype):
    # torchvision: qkv[i] (17, 1, 64) then view(17, 4, 16), once per q, k, v
    ours = check(sliced(dtype=dtype), ["reshape", "slice_by_index", "slice_by_index", "slice_by_index"])
    (reshape,) = ours.functions["main"].find_ops(op_type="reshape")
    assert reshape.outputs[0].shape == (3, 17, 4, 16)
    slices = ours.functions["main"].find_ops(op_type="slice_by_index")
    assert [s.outputs[0].name for s in slices] == ["move_0", "move_1", "move_2"]
    assert all(s.x is reshape.outputs[0] for s in slices)


def test_transpose_after_slices_on_an_inner_axis():
    # a transpose of the kept axes is one transpose of x, whatever the sliced axis
    prog = sliced((4, 2, 6), ("transpose", (1, 0)), n=2, axis=1)
    ours = check(prog, ["transpose", "slice_by_index", "slice_by_index"])
    assert ours.functions["main"].find_ops(op_type="transpose")[0].perm.val.tolist() == [1, 2, 0]


def test_kept_size_one_axis():
    prog = sliced((2, 5, 8), ("reshape", (1, 5, 2, 4)), n=2, squeeze=False)
    check(prog, ["reshape", "slice_by_index", "slice_by_index"])


@pytest.mark.parametrize(
    "case",
    ["different_ops", "one_slice", "use_x", "use_slice", "reshape_on_inner_axis"],
)
def test_not_hoisted(case):
    prog = {
        "different_ops": lambda: sliced(odd=("reshape", (17, 2, 32))),
        "one_slice": lambda: sliced(n=1),
        "use_x": lambda: sliced(extra="use_x"),
        "use_slice": lambda: sliced(extra="use_slice"),
        # x[:, i] then a reshape: done on x it needs a transpose first (two ops)
        "reshape_on_inner_axis": lambda: sliced((4, 2, 6), ("reshape", (4, 3, 2)), n=2, axis=1),
    }[case]()
    check(prog, op_types(prog))


def test_single_index():
    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 5, 8))])
    def prog(x):
        return (
            mb.slice_by_index(x=x, begin=[1, 0, 0], end=[2, 5, 8], squeeze_mask=[True, False, False]),
            mb.slice_by_index(x=x, begin=[0, 0, -1], end=[3, 5, 8], end_mask=[True, True, True]),
            mb.slice_by_index(x=x, begin=[0, 0, 0], end=[3, 5, 8], stride=[1, 1, 2]),
            mb.slice_by_index(x=x, begin=[0, 1, 0], end=[3, 3, 8]),
            mb.slice_by_index(x=x, begin=[0, 0, 0], end=[3, 5, 8]),
        )

    ops = prog.functions["main"].find_ops(op_type="slice_by_index")
    # the -1 with end_mask takes the last index to the end: one index, axis kept
    assert [single_index(op) for op in ops] == [(0, 1, True), (2, 7, False), None, None, None]


def test_torchvision_vit_against_pytorch():
    """The small torchvision ViT with the override: fewer ops than coremltools, no expand_dims or squeeze
    left, the same error against PyTorch at float32 and float16."""
    import sys
    import types as pytypes

    import coremltools as ct
    import torch

    sys.modules.setdefault(
        "torchvision._meta_registrations", pytypes.ModuleType("torchvision._meta_registrations")
    )
    from torchvision.models.vision_transformer import VisionTransformer

    from pattern_infra.testing.convert import convert_exported, op_counts
    from pattern_infra.verification.evaluator import evaluate

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64
    )
    with torch.no_grad():  # a fresh model's zero head and unit norms would hide wrong rewrites
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval()
    x = torch.randn(1, 3, 32, 32)
    expected = model(x).detach().numpy().astype(np.float64)
    exported = torch.export.export(model, (x,)).run_decompositions({})
    for precision, evaluated in ((ct.precision.FLOAT32, "float64"), (ct.precision.FLOAT16, "native")):
        counts, errors = {}, {}
        for on in (False, True):
            prog = convert_exported(
                exported, override=on, minimum_deployment_target=ct.target.iOS18, compute_precision=precision
            )
            counts[on] = op_counts(prog)
            feed = {name: x.numpy() for name in prog.functions["main"].inputs}
            (got,) = evaluate(prog, feed, precision=evaluated).values()
            errors[on] = float(np.max(np.abs(np.asarray(got, np.float64) - expected)))
        assert counts[True]["expand_dims"] == counts[True]["squeeze"] == 0 < counts[False]["expand_dims"]
        assert (
            counts[True]["reshape"] + counts[True]["transpose"]
            < counts[False]["reshape"] + counts[False]["transpose"]
        )
        assert (
            counts[True]["scaled_dot_product_attention"] == counts[False]["scaled_dot_product_attention"] == 2
        )
        assert errors[True] <= errors[False] * (1 + 1e-6) + 1e-12, (precision, errors)
        assert errors[True] < (1e-5 if evaluated == "float64" else 1e-1) * float(np.max(np.abs(expected)))
