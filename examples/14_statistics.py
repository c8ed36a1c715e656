"""Statistics: ``PassStats`` per pass, and ``run_log()`` after a full ``coremltools.convert``.

``import generic_passes`` registers the project's passes under coremltools' pass ids; with
``ENABLE_EXPERIMENTAL_PASSES=1`` set when the conversion runs, they replace coremltools' own passes.
Every run of a generic pass is logged: ``run_log()`` returns ``(pass id, generic?, PassStats)`` for each,
and ``PassStats`` counts anchor ops tried (``attempts``), ops the matcher tried to bind
(``bind_attempts``), structural ``matches``, matches ``rejected`` by ``var_constraints`` or
``declined`` by the transform, ``rewrites``, sweeps (``iterations``) and ``seconds``. Each container
also keeps cumulative ``stats``, and each of its sub-passes its own.

Shown: a MIL program before and after conversion with the override on; which generic passes changed
it, with their counters; the counters of each sub-pass of one of them.
"""

import copy
import os
import textwrap
from collections import defaultdict

import _common as ex
import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

import generic_passes  # noqa: F401  (registers the project's passes)
from pattern_infra import ENV_VAR, PassStats, run_log

rng = np.random.default_rng(0)


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 8))])
def prog(x):
    # linear + constant: common::fuse_linear_bias
    x = mb.add(
        x=mb.linear(x=x, weight=rng.standard_normal((8, 8)).astype(np.float32)),
        y=rng.standard_normal(8).astype(np.float32),
    )
    # the tanh formula of GELU: common::fuse_gelu_tanh_approximation
    inner = mb.mul(x=0.7978845834732056, y=mb.add(x=x, y=mb.mul(x=0.044715, y=mb.pow(x=x, y=3.0))))
    x = mb.mul(x=mb.mul(x=0.5, y=x), y=mb.add(x=1.0, y=mb.tanh(x=inner)))
    # max(x, 0.1 x): common::fuse_leaky_relu
    x = mb.maximum(x=x, y=mb.mul(x=x, y=0.1))
    # two relus: common::merge_consecutive_relus
    x = mb.relu(x=mb.relu(x=x))
    # x * sigmoid(x): mil_backend::fuse_activation_silu
    return mb.mul(x=x, y=mb.sigmoid(x=x))


ex.banner("ct.convert(prog) with ENABLE_EXPERIMENTAL_PASSES=1")
ex.show(prog, "before")
os.environ[ENV_VAR] = "1"
run_log(clear=True)
# ct.convert rewrites a MIL program in place: convert a copy, to keep the original for the comparison
model = ct.convert(
    copy.deepcopy(prog), convert_to="mlprogram", skip_model_load=True, compute_precision=ct.precision.FLOAT32
)
del os.environ[ENV_VAR]
ex.show(model._mil_program, "after")

totals: dict[str, PassStats] = defaultdict(PassStats)
for pass_id, _, stats in run_log(clear=True):
    totals[pass_id].add(stats)
changed = {pass_id: s for pass_id, s in totals.items() if s.rewrites}
print(f"{len(totals)} generic passes ran; {len(changed)} changed the program:")
print(f"  {'pass':<40}{'runs':>5}{'attempts':>9}{'binds':>7}{'matches':>8}{'rewrites':>9}{'ms':>7}")
for pass_id, s in sorted(changed.items()):
    print(
        f"  {pass_id:<40}{s.runs:>5}{s.attempts:>9}{s.bind_attempts:>7}{s.matches:>8}{s.rewrites:>9}"
        f"{1000 * s.seconds:>7.1f}"
    )
unchanged = sorted(set(totals) - set(changed))
print(textwrap.fill("ran without a rewrite: " + ", ".join(unchanged), 100, subsequent_indent="  "))

ex.banner("sub-passes of common::fuse_gelu_tanh_approximation (cumulative)")
for sub in PASS_REGISTRY["common::fuse_gelu_tanh_approximation"].passes:
    s = sub.stats
    print(f"  {sub.name:<14} attempts={s.attempts} matches={s.matches} rewrites={s.rewrites}")

expected = {
    "common::fuse_linear_bias",
    "common::fuse_gelu_tanh_approximation",
    "common::fuse_leaky_relu",
    "common::merge_consecutive_relus",
    "mil_backend::fuse_activation_silu",
}
ex.check(expected <= set(changed), "the five fusions were made by generic passes")
ex.check(ex.op_types(model._mil_program) == ["linear", "gelu", "leaky_relu", "relu", "silu"], "five ops left")
ex.compare(prog, model._mil_program)
