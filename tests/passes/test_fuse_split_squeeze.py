"""``generic::fuse_split_squeeze``: a split into pieces of 1, each squeezed, as one slice per piece."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, types

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import check_new_pass, op_types

PASS = "generic::fuse_split_squeeze"


def unbind(
    shape=(3, 1, 3, 17, 8), *, n=3, axis=0, squeeze_axes=None, dtype=types.fp32, extra=None
) -> Program:
    """timm's ``qkv.unbind(0)``: a split of ``axis`` into ``n`` pieces of 1, each squeezed, each relu'd."""

    @mb.program(input_specs=[mb.TensorSpec(shape=shape, dtype=dtype)])
    def prog(x):
        pieces = mb.split(x=x, split_sizes=[shape[axis] // n] * n, axis=axis, name="split")
        axes = [axis] if squeeze_axes is None else squeeze_axes
        outs = [
            mb.relu(x=mb.squeeze(x=p, axes=axes, name=f"sq_{i}"), name=f"y_{i}") for i, p in enumerate(pieces)
        ]
        if extra == "use_piece":
            outs.append(mb.exp(x=pieces[0], name="other"))
        return tuple(outs)

    return prog


def check(prog: Program, expected: list[str]) -> Program:
    return check_new_pass(PASS, prog, expected, rtol=0.0, atol=0.0)


@pytest.mark.parametrize(
    ("n", "axis", "shape"),
    [(3, 0, (3, 1, 3, 17, 8)), (2, 0, (2, 4, 6)), (3, -1, (4, 5, 3)), (2, 1, (4, 2, 5))],
    ids=["qkv", "kv", "last_axis", "inner_axis"],
)
@pytest.mark.parametrize("dtype", [types.fp32, types.fp16], ids=["fp32", "fp16"])
def test_fused(n, axis, shape, dtype):
    ours = check(
        unbind(shape, n=n, axis=axis, dtype=dtype),
        ["slice_by_index"] * n + ["relu"] * n,
    )
    slices = ours.functions["main"].find_ops(op_type="slice_by_index")
    assert [s.outputs[0].name for s in slices] == [f"sq_{i}" for i in range(n)]
    assert [s.outputs[0].dtype for s in slices] == [dtype] * n


@pytest.mark.parametrize(
    "kwargs",
    [{"shape": (3, 1, 4), "squeeze_axes": [0, 1]}, {"extra": "use_piece"}, {"extra": "one_not_squeezed"}],
    ids=["other_axis_too", "piece_used_elsewhere", "one_piece_not_squeezed"],
)
def test_not_fused(kwargs):
    if kwargs.get("extra") == "one_not_squeezed":  # a split in three, two pieces squeezed: neither pattern

        @mb.program(input_specs=[mb.TensorSpec(shape=(3, 4))])
        def prog(x):
            a, b, c = mb.split(x=x, split_sizes=[1, 1, 1], axis=0)
            return mb.squeeze(x=a, axes=[0]), mb.squeeze(x=b, axes=[0]), mb.relu(x=c)
    else:
        prog = unbind(**kwargs)
    check(prog, op_types(prog))
