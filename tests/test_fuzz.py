"""Property-based fuzzing: random programs of pattern instances and decoys through every generic pass.

Each program chains a few *fragments* (a GELU, an erf GELU, a SiLU, a quick GELU, a linear with a bias
add), each either clean or spoiled by a *decoy*. Every generic pass then runs on it, in id order, with the
override on. The properties:

* no pass crashes and the program stays valid after each one;
* the program computes the same outputs as before (reference evaluator, float64, rtol 1e-6);
* exactly the clean instances are fused: each fragment leaves a signature op (``tanh``, ``erf``,
  ``sigmoid``, ``add`` after ``linear``) only where a decoy forbids the fusion.

``FUZZ_EXAMPLES`` sets the number of programs (CI: a bounded 25, ``make fuzz``: a long campaign).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pattern_infra import generic_passes
from pattern_infra.testing.convert import iter_ops
from pattern_infra.testing.passes import override
from pattern_infra.verification.verify import assert_programs_equivalent

D = 6
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
LONG_CAMPAIGN = "FUZZ_EXAMPLES" in os.environ


SPOILING = frozenset({"extra_consumer", "block_output", "wrong_constant"})


@dataclass(frozen=True)
class Fragment:
    """A pattern instance builder: ``build(x, swap, k) -> (y, intermediate)``; ``k != 1`` skews a constant."""

    name: str
    signature: str
    build: Callable
    spoiled_by: frozenset = SPOILING


def _gelu_tanh(x, swap, k):
    cube = mb.pow(x=x, y=3.0)
    inner = mb.mul(x=cube, y=0.044715 * k) if not swap else mb.mul(x=0.044715 * k, y=cube)
    s = mb.add(x=x, y=inner) if not swap else mb.add(x=inner, y=x)
    t = mb.tanh(x=mb.mul(x=s, y=0.7978845834732056))
    h = mb.mul(x=0.5, y=mb.add(x=t, y=1.0))
    return (mb.mul(x=h, y=x) if not swap else mb.mul(x=x, y=h)), t


def _gelu_erf(x, swap, k):
    e = mb.erf(x=mb.mul(x=x, y=0.7071067690849304 * k))
    a = mb.add(x=e, y=1.0) if not swap else mb.add(x=1.0, y=e)
    return mb.mul(x=mb.mul(x=a, y=0.5), y=x), e


def _silu(x, swap, k):
    s = mb.sigmoid(x=x if k == 1.0 else mb.mul(x=x, y=k))
    return (mb.mul(x=x, y=s) if not swap else mb.mul(x=s, y=x)), s


def _quick_gelu(x, swap, k):
    s = mb.sigmoid(x=mb.mul(x=x, y=1.702 * k) if not swap else mb.mul(x=1.702 * k, y=x))
    return (mb.mul(x=x, y=s) if not swap else mb.mul(x=s, y=x)), s


def _linear_bias(x, swap, k):
    rng = np.random.default_rng(7)
    w = rng.normal(size=(D, D)).astype(np.float32)
    b = rng.normal(size=(D,)).astype(np.float32)
    lin = mb.linear(x=x, weight=w, bias=b)
    extra = np.ones(D, np.float32) * 0.25 * k
    return (mb.add(x=lin, y=extra) if not swap else mb.add(x=extra, y=lin)), lin


FRAGMENTS = [
    Fragment("gelu_tanh", "tanh", _gelu_tanh),
    Fragment("gelu_erf", "erf", _gelu_erf),
    Fragment("silu", "sigmoid", _silu),
    Fragment("quick_gelu", "sigmoid", _quick_gelu),
    # any constant bias fuses, so a skewed constant does not spoil this one
    Fragment("linear_bias", "linear_add", _linear_bias, frozenset({"extra_consumer", "block_output"})),
]
DECOYS = ["clean", "swapped", "shared_root", "nested", "extra_consumer", "block_output", "wrong_constant"]


def build_program(plan):
    """A program chaining the planned fragments; returns it and the expected leftover signatures."""
    expected = Counter(frag.signature for frag, decoy in plan if decoy in frag.spoiled_by)

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, D)), mb.TensorSpec(shape=(1,))])
    def prog(x, flag):
        outputs = []
        for frag, decoy in plan:
            k = 1.1 if decoy == "wrong_constant" else 1.0
            swap = decoy == "swapped"
            if decoy == "nested":
                root = x

                def then_branch(root=root, frag=frag):
                    return frag.build(root, False, 1.0)[0]

                def else_branch(root=root):
                    return mb.sin(x=root)

                pred = mb.squeeze(x=mb.greater(x=flag, y=0.0))
                y = mb.cond(pred=pred, _true_fn=then_branch, _false_fn=else_branch)
            else:
                y, inner = frag.build(x, swap, k)
                if decoy == "extra_consumer":
                    y = mb.add(x=y, y=mb.sin(x=inner))
                elif decoy == "block_output":
                    outputs.append(inner)
            if decoy == "shared_root":
                y = mb.add(x=y, y=x)
            x = mb.relu(x=y)
        return [x] + outputs

    return prog, expected


def leftovers(prog) -> Counter:
    """Signature ops left in the program (all blocks)."""
    found = Counter()
    for op in iter_ops(prog):
        if op.op_type in ("tanh", "erf", "sigmoid"):
            found[op.op_type] += 1
        if op.op_type == "add":
            ins = [op.x, op.y]
            from_linear = any(v.op is not None and v.op.op_type == "linear" for v in ins)
            if from_linear and any(v.val is not None for v in ins):
                found["linear_add"] += 1  # a constant bias add left after a linear
    return found


plans = st.lists(st.tuples(st.sampled_from(FRAGMENTS), st.sampled_from(DECOYS)), min_size=1, max_size=4)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG_CAMPAIGN,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(plan=plans)
def test_every_generic_pass_on_random_programs(plan):
    prog, expected = build_program(plan)
    original = copy.deepcopy(prog)
    baseline = leftovers(prog)
    with override(True):
        for container in generic_passes().values():
            container.set_options(None)
            container(prog)
            prog.validate()
    got = leftovers(prog)
    # the signatures left are exactly those of the spoiled instances
    assert {k: got[k] for k in baseline} == {k: expected[k] for k in baseline}, (plan, str(prog))
    # Passes fold constants in the program's dtype (fp32), as coremltools does: a folded bias carries
    # fp32 rounding (~6e-8 of operands of size ~5), which can cancel down to a small output, hence an
    # absolute term of 1e-6 besides rtol 1e-6.
    assert_programs_equivalent(original, prog, trials=2, rtol=1e-6, atol=1e-6, seed=len(plan))


def test_the_fuzzer_can_see_a_wrong_fusion(namespace):
    # A deliberately wrong pass (tanh GELU fused as the exact GELU) must fail the same numerical check.
    from generic_passes.fuse_gelu_tanh_approximation import gelu_tanh_pattern_1
    from pattern_infra import register_generic_pass

    def wrong(p):
        p.replace_output(mb.gelu(x=p.root_var, mode="EXACT", before_op=p.final_op))

    register_generic_pass(gelu_tanh_pattern_1, None, wrong, "wrong", namespace)
    prog, _ = build_program([(FRAGMENTS[0], "clean")])
    original = copy.deepcopy(prog)
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    PASS_REGISTRY[f"{namespace}::wrong"](prog)
    assert leftovers(prog)["tanh"] == 0
    with pytest.raises(AssertionError):
        assert_programs_equivalent(original, prog, trials=2, rtol=1e-6, atol=1e-9, seed=0)
