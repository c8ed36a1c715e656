"""Replacements of coremltools' cleanup passes (issue 17): the same program as coremltools' pass gives.

``common::topological_reorder``, ``reduce_transposes``, ``const_elimination`` and
``dead_code_elimination`` are plain graph passes under coremltools' ids (``generic_passes.CLEANUP_PASSES``).
Each is compared with coremltools' own pass on the same program, and whole conversions with and without
them (pass by pass and through ``pattern_infra.pipeline()``) must give the same program. coremltools' own
tests of these passes run in ``tests/coremltools_suite``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

import generic_passes
from bench.llm_workloads import llama_decoder, synthetic_mix
from generic_passes import CLEANUP_PASSES, coremltools_cleanup
from generic_passes.topological_reorder import _GAP, _Order
from pattern_infra import PassContainer, PassRegistrationError, override, pipeline, register_graph_pass
from pattern_infra.testing.pipelines import converted, program_signature


def _both(build: Callable[[], Program], pass_id: str) -> tuple[Any, Any]:
    """Signatures of ``build()`` after coremltools' pass and after ours (override on), name counter reset."""
    container = PASS_REGISTRY.passes[pass_id]
    assert isinstance(container, PassContainer) and container.replaces is not None
    results = []
    for ours in (False, True):
        mb.name_count.clear()  # the builder names consts and ops from a global counter
        prog = build()
        mb.name_count.clear()
        with override(ours):
            PASS_REGISTRY[pass_id](prog)
        prog.validate()
        results.append(program_signature(prog))
    return results[0], results[1]


def test_every_cleanup_pass_replaces_coremltools_pass():
    for pass_id in CLEANUP_PASSES:
        container = PASS_REGISTRY.passes[pass_id]
        assert isinstance(container, PassContainer) and container.replaces is not None
        assert container.validate is False  # the pipeline validates after the entry
    with coremltools_cleanup():
        assert all(isinstance(PASS_REGISTRY.passes[p], type) for p in CLEANUP_PASSES)
    assert all(isinstance(PASS_REGISTRY.passes[p], PassContainer) for p in CLEANUP_PASSES)


# -- topological_reorder -----------------------------------------------------------------------------


def _reorder_program() -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def prog(x):
        c = mb.cast(x=x, dtype="fp16", name="c0")
        sq = mb.square(x=c, name="sq")
        t1 = mb.transpose(x=sq, perm=[1, 0], name="t1")
        back1 = mb.cast(x=t1, dtype="fp32", name="back1")
        lg = mb.log(x=c, name="lg")
        t2 = mb.transpose(x=lg, perm=[1, 0], name="t2")
        back2 = mb.cast(x=t2, dtype="fp32", name="back2")
        r = mb.relu(x=c, name="r")
        r32 = mb.cast(x=r, dtype="fp32", name="r32")
        tt = mb.transpose(x=mb.transpose(x=c, perm=[1, 0], name="ta"), perm=[1, 0], name="tb")
        cc = mb.cast(x=c, dtype="fp32", name="cc")
        out = mb.add(x=mb.relu(x=r32, name="r2"), y=cc, name="out")
        return back1, back2, out, mb.cast(x=tt, dtype="fp32", name="tt32"), mb.relu(x=c, name="last")

    return prog


def _many_casts_before_one_reader(n: int) -> Program:
    """``n`` casts all first read by one concat: each moved copy lands right before it, between the
    previous copy and the concat, so the order labels touch and the block is relabelled."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4))])
    def prog(x):
        casts = [mb.cast(x=mb.relu(x=x, name=f"r{i}"), dtype="fp16", name=f"c{i}") for i in range(n)]
        spacer = mb.relu(x=x, name="spacer")
        cat = mb.concat(values=casts, axis=0, name="cat")
        return mb.add(x=mb.cast(x=cat, dtype="fp32", name="cat32"), y=mb.reduce_sum(x=spacer, name="s"))

    return prog


@pytest.mark.parametrize(
    "build",
    [_reorder_program, lambda: _many_casts_before_one_reader(3), lambda: _many_casts_before_one_reader(70)],
    ids=["mixed", "few_casts", "relabelled"],
)
def test_topological_reorder_gives_coremltools_program(build):
    theirs, ours = _both(build, "common::topological_reorder")
    assert ours == theirs
    mb.name_count.clear()
    assert ours != program_signature(build())  # the pass moved something


def test_topological_reorder_relabels_when_labels_touch(monkeypatch):
    relabels: list[int] = []
    original = _Order.relabel

    def counted(self):
        relabels.append(1)
        original(self)

    monkeypatch.setattr(_Order, "relabel", counted)
    prog = _many_casts_before_one_reader(_GAP.bit_length() + 8)  # more insertions at one place than halvings
    with override(True):
        PASS_REGISTRY["common::topological_reorder"](prog)
    assert len(relabels) > 1  # the first labelling, then at least one relabelling


# -- reduce_transposes -------------------------------------------------------------------------------


def _transposes(cancellable: bool) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 2, 3, 4))])
    def prog(x):
        t = mb.transpose(x=x, perm=[0, 2, 3, 1], name="t")
        r = mb.relu(x=t, name="r")
        if cancellable:
            return mb.transpose(x=r, perm=[0, 3, 1, 2], name="back")
        return mb.reduce_mean(x=r, axes=[1], keep_dims=False, name="m")

    return prog


@pytest.mark.parametrize("cancellable", [True, False])
def test_reduce_transposes_gives_coremltools_program(cancellable):
    theirs, ours = _both(lambda: _transposes(cancellable), "common::reduce_transposes")
    assert ours == theirs
    types = [op_type for _, op_type, _ in ours[1]]
    assert ("transpose" in types) is not cancellable


def test_reduce_transposes_reinfers_only_after_cancelling(monkeypatch):
    from coremltools.converters.mil.mil import Operation

    calls: list[str] = []
    original = Operation.type_value_inference

    def counted(self, overwrite_output=False):
        if overwrite_output:
            calls.append(self.name)
        return original(self, overwrite_output=overwrite_output)

    monkeypatch.setattr(Operation, "type_value_inference", counted)
    for cancellable, reinferred in ((False, False), (True, True)):
        calls.clear()
        prog = _transposes(cancellable)
        with override(True):
            PASS_REGISTRY["common::reduce_transposes"](prog)
        assert bool(calls) is reinferred


# -- const_elimination and dead_code_elimination -------------------------------------------------------


def _foldable(fold: bool, dead: bool, constexpr: bool = False) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def prog(x):
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        y = mb.add(x=a, y=a, name="double") if fold else a
        if constexpr:
            y = mb.add(
                x=y, y=mb.constexpr_cast(source_val=a.astype(np.float16), output_dtype="fp32", name="ce")
            )
        if dead:
            mb.relu(x=x, name="unused")
        return mb.add(x=x, y=y, name="out")

    return prog


@pytest.mark.parametrize("pass_id", ["common::const_elimination", "common::dead_code_elimination"])
@pytest.mark.parametrize(
    "fold,dead,constexpr",
    [
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (True, True, True),
        (False, False, True),
    ],
)
def test_cleanup_gives_coremltools_program(pass_id, fold, dead, constexpr):
    theirs, ours = _both(lambda: _foldable(fold, dead, constexpr), pass_id)
    assert ours == theirs


@pytest.mark.parametrize(
    "pass_id,build,runs",
    [
        ("common::const_elimination", lambda: _foldable(False, True), False),
        ("common::const_elimination", lambda: _foldable(True, False), True),
        ("common::const_elimination", lambda: _foldable(False, False, constexpr=True), True),
        ("common::dead_code_elimination", lambda: _foldable(True, False), False),
        ("common::dead_code_elimination", lambda: _foldable(False, True), True),
        ("common::dead_code_elimination", lambda: _foldable(False, False, constexpr=True), True),
    ],
    ids=["ce-nothing", "ce-fold", "ce-constexpr", "dce-nothing", "dce-dead", "dce-constexpr"],
)
def test_cleanup_runs_coremltools_pass_only_when_it_would_change_something(monkeypatch, pass_id, build, runs):
    original = PASS_REGISTRY.passes[pass_id].replaces
    ran: list[bool] = []
    monkeypatch.setattr(original, "apply", lambda self, prog: ran.append(True))
    with override(True):
        PASS_REGISTRY[pass_id](build())
    assert bool(ran) is runs


def test_const_elimination_passes_skip_const_by_size_on():
    def with_threshold() -> PassPipeline:
        base = PassPipeline.DEFAULT
        base.set_options("common::const_elimination", {"skip_const_by_size": "10"})
        return base

    def source() -> Program:
        @mb.program(input_specs=[mb.TensorSpec(shape=(100,))])
        def prog(x):
            big = mb.fill(
                shape=np.array([100], dtype=np.int32), value=2.0, name="big"
            )  # folded unless skipped
            return mb.mul(x=x, y=big, name="out")

        return prog

    skipped = converted(source, with_threshold, override=False)
    for pass_pipeline in (with_threshold, lambda: pipeline(with_threshold())):
        assert program_signature(converted(source, pass_pipeline)) == program_signature(skipped)
    assert "fill" in [op.op_type for op in skipped.functions["main"].operations]
    assert "fill" not in [op.op_type for op in converted(source).functions["main"].operations]


# -- whole conversions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source,options",
    [
        (lambda: synthetic_mix(300), {}),
        (lambda: llama_decoder(2, heads=2), {}),
        (lambda: llama_decoder(2, heads=2), {"compute_precision": ct.precision.FLOAT32}),
    ],
    ids=["mix", "llama-fp16", "llama-fp32"],
)
def test_whole_conversion_same_program_with_and_without_replacements(source, options):
    with coremltools_cleanup():
        today = program_signature(converted(source, **options))
        today_swept = program_signature(converted(source, pipeline, **options))
    replaced = program_signature(converted(source, **options))
    replaced_swept = program_signature(converted(source, pipeline, **options))
    assert today == today_swept == replaced == replaced_swept


def test_register_graph_pass_refuses_what_it_cannot_run():
    with pytest.raises(PassRegistrationError, match="must be a callable"):
        register_graph_pass("not a function", "some_pass", "generic")  # type: ignore[arg-type]
    with pytest.raises(PassRegistrationError, match="already holds"):
        register_graph_pass(lambda prog: None, "fuse_gelu_exact", "common")
    with pytest.raises(ValueError, match="does not replace"):
        with coremltools_cleanup(("generic::fuse_sdpa",)):
            pass
    assert generic_passes.CLEANUP_PASSES == CLEANUP_PASSES
