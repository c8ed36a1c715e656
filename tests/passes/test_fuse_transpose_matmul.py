"""``common::fuse_transpose_matmul``: ``transpose`` of the last two axes into ``matmul``'s flags.

coremltools leaves a ``transpose`` that its rewrite made dead in the program; this pass removes it. So
the reference here is coremltools' program after ``common::dead_code_elimination`` (``DCE``).
"""

from __future__ import annotations

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra.testing.passes import assert_same_program, check_fused, check_not_fused, op_types, run_both
from pattern_infra.verification.verify import assert_programs_equivalent

PASS = "common::fuse_transpose_matmul"
DCE = ["common::dead_code_elimination"]


SWAP = {2: [1, 0], 3: [0, 2, 1], 4: [0, 1, 3, 2]}
SWAP_NEGATIVE = {2: [-1, -2], 3: [0, -1, -2], 4: [0, 1, -1, -2]}


def matmul_prog(
    rank: int = 3,
    fuse_x: bool = True,
    fuse_y: bool = True,
    *,
    transpose_x: bool = False,
    transpose_y: bool = False,
    negative_perm: bool = False,
    extra: str | None = None,
) -> Program:
    """``matmul(a', b')`` where ``a'``/``b'`` are ``a``/``b`` transposed on their last two axes if asked."""
    batch = (2, 3, 4)[: rank - 2]
    m, k, n = 5, 6, 7
    a_mat = (m, k) if transpose_x else (k, m)  # the shape that, transposed, the matmul reads
    a_mat = a_mat if fuse_x else a_mat[::-1]
    b_mat = (k, n) if transpose_y else (n, k)
    b_mat = b_mat if fuse_y else b_mat[::-1]
    perm = (SWAP_NEGATIVE if negative_perm else SWAP)[rank]

    @mb.program(input_specs=[mb.TensorSpec(shape=batch + a_mat), mb.TensorSpec(shape=batch + b_mat)])
    def prog(a, b):
        ta = mb.transpose(x=a, perm=perm, name="ta") if fuse_x else a
        tb = mb.transpose(x=b, perm=perm, name="tb") if fuse_y else b
        out = mb.matmul(x=ta, y=tb, transpose_x=transpose_x, transpose_y=transpose_y, name="mm")
        if extra == "use_transpose":
            return out, mb.relu(x=ta)
        if extra == "out_transpose":
            return out, ta
        return out

    return prog


@pytest.mark.parametrize("transpose_y", [False, True], ids=["ty0", "ty1"])
@pytest.mark.parametrize("transpose_x", [False, True], ids=["tx0", "tx1"])
@pytest.mark.parametrize(
    "fuse_x, fuse_y", [(True, True), (True, False), (False, True)], ids=["both", "x_only", "y_only"]
)
def test_fused_as_coremltools_does(fuse_x, fuse_y, transpose_x, transpose_y):
    prog = matmul_prog(3, fuse_x, fuse_y, transpose_x=transpose_x, transpose_y=transpose_y)
    ours = check_fused(PASS, prog, ["matmul"], reference_cleanup=DCE)
    mm = ours.functions["main"].operations[-1]
    assert (mm.name, bool(mm.transpose_x.val), bool(mm.transpose_y.val)) == (
        "mm",
        transpose_x != fuse_x,
        transpose_y != fuse_y,
    )


@pytest.mark.parametrize("negative_perm", [False, True], ids=["perm", "negative_perm"])
@pytest.mark.parametrize("rank", [2, 4])
def test_ranks_and_negative_perm(rank, negative_perm):
    check_fused(PASS, matmul_prog(rank, negative_perm=negative_perm), ["matmul"], reference_cleanup=DCE)


def test_one_transpose_feeding_both_sides():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4, 4))])
    def prog(a):
        t = mb.transpose(x=a, perm=[0, 2, 1])
        return mb.matmul(x=t, y=t, transpose_y=True, name="mm")

    check_fused(PASS, prog, ["matmul"], reference_cleanup=DCE)


@pytest.mark.parametrize("extra", ["use_transpose", "out_transpose"])
def test_transpose_with_other_users_stays_for_them(extra):
    """As in coremltools: the ``matmul`` no longer reads the ``transpose``, which is kept for the others."""
    expected = ["transpose", "matmul"] + (["relu"] if extra == "use_transpose" else [])
    check_fused(PASS, matmul_prog(extra=extra), expected, reference_cleanup=DCE)


def test_transpose_of_other_axes_keeps_its_side():
    """``perm`` (1, 0, 2) moves the batch axis: only the ``y`` side is fused."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(5, 2, 6)), mb.TensorSpec(shape=(2, 7, 6))])
    def prog(a, b):
        ta = mb.transpose(x=a, perm=[1, 0, 2])
        tb = mb.transpose(x=b, perm=[0, 2, 1])
        return mb.matmul(x=ta, y=tb, name="mm")

    check_fused(PASS, prog, ["transpose", "matmul"], reference_cleanup=DCE)


def test_no_fusable_transpose_is_left_alone():
    @mb.program(input_specs=[mb.TensorSpec(shape=(5, 2, 6)), mb.TensorSpec(shape=(6, 2, 7))])
    def prog(a, b):
        return mb.matmul(x=mb.transpose(x=a, perm=[1, 0, 2]), y=mb.transpose(x=b, perm=[1, 0, 2]))

    check_not_fused(PASS, prog, reference_cleanup=DCE)


def test_chain_of_matmuls():
    @mb.program(input_specs=[mb.TensorSpec(shape=(4, 3)), mb.TensorSpec(shape=(5, 4))])
    def prog(a, b):
        first = mb.matmul(x=mb.transpose(x=a, perm=[1, 0]), y=mb.transpose(x=b, perm=[1, 0]))
        return mb.matmul(x=mb.transpose(x=first, perm=[1, 0]), y=np.ones((3, 2), np.float32))

    check_fused(PASS, prog, ["matmul", "matmul"], reference_cleanup=DCE)


def test_transpose_of_a_transpose_is_fused_to_the_end():
    """coremltools makes one sweep and leaves ``matmul(transpose(a), transpose_x=True)``; the driver
    revisits the new ``matmul`` and fuses the inner ``transpose`` too."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 4)), mb.TensorSpec(shape=(4, 5))])
    def prog(a, b):
        twice = mb.transpose(x=mb.transpose(x=a, perm=[1, 0]), perm=[1, 0])
        return mb.matmul(x=twice, y=b, name="mm")

    outcome = run_both(PASS, prog, reference_cleanup=DCE)
    assert op_types(outcome.coremltools) == ["transpose", "matmul"]
    assert op_types(outcome.ours) == ["matmul"]
    mm = outcome.ours.functions["main"].operations[-1]
    assert mm.x is outcome.ours.functions["main"].inputs["a"] and not mm.transpose_x.val
    assert_programs_equivalent(prog, outcome.ours)


def test_transpose_in_an_enclosing_block():
    """Pattern 5: the ``matmul`` is inside a ``cond``, the ``transpose`` outside. Its ``transpose``
    is not part of the match, so it is left dead as coremltools leaves it."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 4)), mb.TensorSpec(shape=(3, 5))])
    def prog(a, b):
        t = mb.transpose(x=a, perm=[1, 0])

        def branch():
            return mb.matmul(x=t, y=b, name="mm")

        return mb.cond(pred=True, _true_fn=branch, _false_fn=branch)

    outcome = run_both(PASS, prog)
    assert_same_program(outcome.coremltools, outcome.ours)
    for inner in outcome.ours.functions["main"].find_ops(op_type="cond")[0].blocks:
        mm = inner.find_ops(op_type="matmul")[0]
        assert mm.x.name == "a" and mm.transpose_x.val
    assert_programs_equivalent(prog, outcome.ours)
