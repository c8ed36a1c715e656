"""The stateful KV-cache decoder (pattern_infra.testing.stateful) and the evaluator's state ops.

Default suite: the evaluator's ``read_state`` / ``coreml_update_state`` on small MIL programs, and the
decoder's static decode step converted with the override off and on. Slow (``--run-slow``): the decoder
with flexible query and cache lengths, over a prefill and two decode steps.
"""

from __future__ import annotations

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types
from test_torch_support import RUN_TIME_SLICE_END

from pattern_infra.testing.convert import op_counts
from pattern_infra.verification.errors import EvaluationError
from pattern_infra.verification.evaluator import evaluate, initial_state

STATE_OPS = ("read_state", "coreml_update_state", "slice_update")
RTOL = 1e-5
"""Relative error against PyTorch (max abs error over max abs logit). The evaluator computes in float64
and holds the fp16 state in float64 too (an fp16 cast is the identity in float64 precision), so the
comparison is with PyTorch's fp32 cache; the fp16 rounding of the state on a device is not measured."""


@mb.program(
    input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp16), mb.StateTensorSpec((2, 3), dtype=types.fp16)],
    opset_version=ct.target.iOS18,
)
def _accumulate(x, acc):
    total = mb.add(x=mb.read_state(input=acc), y=x)
    mb.coreml_update_state(state=acc, value=total)
    return mb.mul(x=total, y=np.float16(2.0))


def test_state_is_carried_from_call_to_call():
    state = initial_state(_accumulate)
    assert list(state) == ["acc"] and not state["acc"].any()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for step in range(1, 4):
        (out,) = evaluate(_accumulate, {"x": x}, state=state).values()
        np.testing.assert_array_equal(state["acc"], step * x)
        np.testing.assert_array_equal(out, 2 * step * x)


def test_read_state_returns_a_copy():
    @mb.program(input_specs=[mb.StateTensorSpec((3,), dtype=types.fp16)], opset_version=ct.target.iOS18)
    def before_and_after(s):
        old = mb.read_state(input=s)
        mb.coreml_update_state(state=s, value=mb.add(x=old, y=np.float16(1.0)))
        return mb.identity(x=old), mb.read_state(input=s)

    state = {"s": np.array([1.0, 2.0, 3.0])}
    old, new = evaluate(before_and_after, {}, state=state).values()
    np.testing.assert_array_equal(old, [1, 2, 3])
    np.testing.assert_array_equal(new, [2, 3, 4])


def test_missing_state_names_the_fix():
    x = np.zeros((2, 3), dtype=np.float32)
    with pytest.raises(EvaluationError, match=r"state=initial_state\(prog\)"):
        evaluate(_accumulate, {"x": x})
    with pytest.raises(EvaluationError, match="go in state="):
        evaluate(_accumulate, {"x": x, "acc": x}, state={"acc": x})
    with pytest.raises(EvaluationError, match="state 'acc'"):
        evaluate(_accumulate, {"x": x}, state={"acc": np.zeros((3, 2))})


# -- the decoder ----------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

from pattern_infra.testing import stateful  # noqa: E402  (needs torch)


def _counts(prog) -> dict[str, int]:
    counts = op_counts(prog)
    counts.pop("const", None)
    return counts


@pytest.fixture(scope="module")
def decoder():
    return stateful.stateful_decoder()


@pytest.fixture(scope="module")
def static_step(decoder):
    """The decode step after a 4-token prefill, exported static, converted with the override off and on."""
    exported = stateful.export_decoder(decoder, flexible=False)
    return {on: stateful.convert_decoder(exported, override=on)._mil_program for on in (False, True)}


def _assert_state_ops_intact(off, on):
    for op_type in STATE_OPS:
        assert _counts(on)[op_type] == _counts(off)[op_type] > 0, op_type


def test_static_decode_step_fuses_with_the_state_ops_intact(static_step):
    off, on = (_counts(static_step[flag]) for flag in (False, True))
    assert off["tile"] > 0 and off["softmax"] == 2  # repeat_kv and written-out attention, as converted
    assert on.get("tile", 0) == 0 and on["scaled_dot_product_attention"] == 2
    assert on.get("softmax", 0) == 0 and on.get("matmul", 0) == 0
    assert sum(on.values()) < sum(off.values())
    _assert_state_ops_intact(static_step[False], static_step[True])


@pytest.mark.parametrize("override", [False, True], ids=["off", "on"])
def test_static_decode_step_equals_pytorch(decoder, static_step, override):
    """The step continues from PyTorch's cache after the prefill; logits and the new cache compared."""
    steps = stateful.decode_steps()[:2]
    state = stateful.torch_cache(decoder, steps[:1])
    got = stateful.run_steps(static_step[override], steps[1:], state)
    assert stateful.relative_error(got, stateful.torch_steps(decoder, steps)[1:]) < RTOL
    for name, want in stateful.torch_cache(decoder, steps).items():
        np.testing.assert_allclose(state[name], want, rtol=RTOL, atol=1e-6)


@RUN_TIME_SLICE_END
@pytest.mark.slow
def test_flexible_decoder_fuses_and_equals_pytorch_over_prefill_and_two_decode_steps(decoder):
    exported = stateful.export_decoder(decoder, flexible=True)
    progs = {on: stateful.convert_decoder(exported, override=on)._mil_program for on in (False, True)}
    off, on = _counts(progs[False]), _counts(progs[True])
    assert on["scaled_dot_product_attention"] == 2 and on.get("softmax", 0) == 0 and on.get("matmul", 0) == 0
    assert sum(on.values()) < sum(off.values())
    _assert_state_ops_intact(progs[False], progs[True])
    # one tile: the causal mask repeated for the grouped query rows, shared by the layers (the decision
    # of generic::fuse_grouped_kv_attention); repeat_kv's are folded into the attention
    assert [op.x.name for op in progs[True].functions["main"].find_ops(op_type="tile")] == ["causal_mask"]
    for prog in progs.values():
        # each cache update writes the new keys and values as they are (torch_support's copy: torch.export
        # proved the slice [S - L, S) L long), never a broadcast of them
        for op in prog.functions["main"].find_ops(op_type="slice_update"):
            assert op.update.op is None or op.update.op.op_type != "tile", op.name
    negations = [
        op
        for op in progs[True].functions["main"].find_ops(op_type="mul")
        if op.y.val is not None and np.asarray(op.y.val).size == 1 and float(op.y.val) == -1.0
    ]
    assert not negations  # the rotate_half sign lives in the shared sin
    steps = stateful.decode_steps()
    want = stateful.torch_steps(decoder, steps)
    for on_off in (False, True):
        assert stateful.relative_error(stateful.run_steps(progs[on_off], steps), want) < RTOL


@RUN_TIME_SLICE_END
@pytest.mark.slow
def test_flexible_conversion_is_the_same_program_under_every_hash_seed():
    """Two processes with hash seeds under which coremltools' own ``copy`` converter gave different
    programs (it picks a broadcast's symbol in set order) convert the export to the same op sequence."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import json; from pattern_infra.testing import stateful; "
        "exported = stateful.export_decoder(stateful.stateful_decoder(), flexible=True); "
        "print(json.dumps([[op.op_type for op in stateful.convert_decoder(exported, override=on)"
        "._mil_program.functions['main'].operations] for on in (False, True)]))"
    )
    root = str(Path(__file__).resolve().parents[1])
    programs = []
    for seed in ("0", "7"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=root
        )
        programs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert programs[0] == programs[1]
    assert programs[0][1].count("tile") == 1
