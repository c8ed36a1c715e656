"""Reference: ``common::fuse_layernorm_or_instancenorm`` as it was before it was written with ``one_of``
(112 sub-passes, 708 lines), kept unchanged but for its registration (:func:`register`, under another
namespace) so that ``test_layernorm_rewrite.py`` compares the programs both give.

The original docstring follows.

``common::fuse_layernorm_or_instancenorm``: normalisations written out op by op into one op.

Math: over the reduced axes ``A`` of ``x``, with ``mean = E_A[x]`` and ``var = E_A[(x - mean)^2]``,

    layer_norm(x, axes=A, gamma, beta, eps) = gamma * (x - mean) / sqrt(var + eps) + beta

The same value is reached by many association orders, all of them used by converted models:

* ``(x - mean) * rsqrt(var + eps)`` = ``(x - mean) / sqrt(var + eps)`` = ``(x - mean) / pow(var + eps, 0.5)``;
* ``gamma * ((x - mean) / s)`` = ``(gamma * (x - mean)) / s``  (gamma scales before or after the division);
* ``x * k + (beta - mean * k)`` with ``k = gamma * rsqrt(var + eps)``  (the "folded" TF form);
* ``var = E[x^2] - E[x]^2``, with ``E[.]`` written as ``reduce_sum * (1 / N)``;
* ``(x - mean)^2`` as ``square(d)``, ``mul(d, d)`` or ``pow(d, 2)``.

Patterns 1-5 are coremltools' own (same numbering); the written-out family is what coremltools misses.
``d = x - mean``, ``v = reduce_mean(...) + eps``; operand order of commutative ops is never drawn::

    Pattern 1 (TF BERT, folded):  y = x * k + (beta - mean * k),  k = gamma * rsqrt(v)

        x --> reduce_mean --> mean -----------------------------------------+
        |                      |                                            v
        +-----------------> sub(x, mean) --> square --> reduce_mean --> add(eps) --> rsqrt --> mul(gamma) = k
        |                                                                                          |
        |                      mean -------------------------> mul(mean, k) <---------------------+
        |                                                            |                             |
        |                                                            v                             |
        |                                                  sub(beta, mean * k) --+                 |
        |                                                                        v                 |
        +---------------------------------------------------> mul(x, k) ------> add --> y  <------+

    Pattern 3 (TensorFlow-Addons instance norm, no gamma/beta):  y = x * r + (mean * r) * -1

        x --> reduce_mean = mean --> sub(x, mean) --> square --> reduce_mean --> add(eps) --> rsqrt = r
        |                    |                                                                   |
        |                    +--> mul(mean, r) <-------------------------------------------------+
        |                              |                                                         |
        |                              v                                                         |
        |                          mul(., -1) ----------------+                                  |
        |                                                     v                                  |
        +---------------------------------> mul(x, r) ------> add --> y  <-----------------------+

    Pattern 4 (E[x^2] - E[x]^2 with reduce_sum):  m = reduce_sum(x) * (1/N),  same tail as pattern 1

        x --> mul(x, x) --> reduce_sum --> mul(1/N) = E[x^2] --+
        |                                                      v
        x --> reduce_sum --> mul(1/N) = m --> mul(m, m) --> sub(E[x^2], m^2) --> add(eps) --> rsqrt --+
        |                             |                                                                 |
        |                             |                                               k = mul(gamma) <--+
        |                             +--> mul(m, k) --> sub(beta, m * k) --+
        +--------------------------------> mul(x, k) ---------------------> add --> y

    Pattern 5 (ml-ane-transformers BC1S, axes exactly [1]; beta applied *before* gamma):
    y = [d * rsqrt(v) (+ beta)] (* gamma)

        x --> reduce_mean --> sub(x, mean) = d --> mul(d, d) --> reduce_mean --> add(eps) --> rsqrt
                                             |                                                  |
                                             +--------------> mul(d, rsqrt) <-------------------+
                                                                   |
                                                                   +--> [add(beta) --> mul(gamma)] --> y

    Written-out family, ``written_out_pattern(subs, square, normalizer, gamma, beta)``: the PyTorch
    ``w * (x - u) / torch.sqrt(var + eps) + b`` in every form coremltools 9.0 hands this pass
    (coremltools' pattern 2 is the member ("sub2", "square", "pow", "after", "beta"), and pattern 5
    without affine the member ("sub1", "mul", "rsqrt", "none", "nobeta")):

        x --> reduce_mean = u --> sub(x, u) = d --> SQUARE(d) --> reduce_mean --> add(eps) --> ROOT
        |                    |                |                                                  |
        |                    +-> [sub(x, u) = d'] (subs "sub2"; else d' = d)                     |
        |                                |                                                       |
        |                                v                                                       v
        +---------------------> [mul(w, d') (gamma "before")] --------------------------------> APPLY
                                                                                                 |
                                      y <-- [add(b) (beta "beta")] <-- [mul(w) (gamma "after")] <--+

        subs:              "sub1" one ``x - u``; "sub2" a second one for the numerator (what reaches
                           this pass from ``torch.export``: ``remove_redundant_ops`` merges them later)
        square:            "pow" pow(d, 2) | "mul" mul(d, d) | "square" square(d)
        normalizer:        "sqrt"  ROOT = sqrt,          APPLY = real_div(numerator, ROOT)
                           "pow"   ROOT = pow(., 0.5),   APPLY = real_div(numerator, ROOT)
                           "rsqrt" ROOT = rsqrt,         APPLY = mul(numerator, ROOT)
        gamma, beta:       optional, as drawn

Every pattern becomes one op (or, for an NHWC instance norm, a transpose sandwich)::

        x --> layer_norm(axes, gamma, beta, eps) --> y
        x --> instance_norm(gamma, beta, eps) --> y                                   (rank 4, axes [-2, -1])
        x --> transpose(0,3,1,2) --> instance_norm --> transpose(0,2,3,1) --> y       (rank 4, axes [-3, -2])

Which op, decided as coremltools decides (so the program is the one coremltools produces wherever it
fuses): ``layer_norm`` when the axes are the trailing ones and gamma/beta have one dimension per axis, or
for rank 4 and axes [-3] (channels-first, gamma/beta of shape [C]); ``instance_norm`` for rank 4, axes
[-2, -1] or [-3, -2], and gamma/beta that squeeze to [C]. The inserted ops sit before the last matched op;
the norm takes the name of the output it replaces (``<name>_layernorm`` / ``<name>_instancenorm``
between ``<name>_transpose_nhwc_nchw`` and ``<name>_transpose_nchw_nhwc`` for NHWC).

Beyond coremltools, and correct by the math above:

* the input ``x`` may have any other consumers (pre-norm residual stream); coremltools counts them;
* child order, operand order and the ``mul(-1)`` operand position never matter;
* the written-out family; gamma/beta of any shape that acts along the normalised axes only (``[C,1,1]``
  for ConvNeXt channels-first, ``[1,1,D]``, a scalar), reshaped or broadcast to the normalised shape;
* a gamma or beta that cannot be absorbed (not a constant, a ``constexpr``, acting along another axis,
  or its intermediate used elsewhere) stays an op after the fused norm instead of blocking the fusion;
  patterns run longest first, so the shorter ones only take what a longer one left.

Refusals coremltools lacks, because its fusion would be wrong or would crash: the two reductions differ in
axes; gamma/beta act along an axis that is not normalised (e.g. a ``[C]`` gamma on an NCHW axes-[1] norm,
a ``[1,1,1,W]`` gamma on an instance norm); the ``1/N`` of pattern 4 is not ``1/N``; broadcasting makes the
output shape differ from ``x``'s. Like coremltools, ``rsqrt``'s own ``epsilon`` (``1e-12`` by default) is
not added to ``eps``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Program, get_new_symbol

from generic_passes._norm_plan import constraints_1 as _constraints_1
from generic_passes._norm_plan import constraints_3 as _constraints_3
from generic_passes._norm_plan import constraints_4 as _constraints_4
from generic_passes._norm_plan import constraints_5_affine as _constraints_5_affine
from generic_passes._norm_plan import constraints_written_out as _constraints_written_out
from generic_passes._norm_plan import transform_norm
from pattern_infra import ConstRule, Pattern, register_generic_pass

__all__ = [
    "PASS_NAME",
    "layernorm_pattern_1",
    "instancenorm_pattern_3",
    "instancenorm_pattern_4",
    "layernorm_pattern_5",
    "layernorm_pattern_5_affine",
    "instancenorm_pattern_2",
    "WRITTEN_OUT_PATTERNS",
    "written_out_pattern",
]

logger = logging.getLogger(__name__)

PASS_NAME = "fuse_layernorm_or_instancenorm"

_RANK3 = [get_new_symbol(), get_new_symbol(), get_new_symbol()]
_RANK4 = [get_new_symbol(), get_new_symbol(), get_new_symbol(), get_new_symbol()]
_GAMMA = np.float32(1.5)  # placeholders: the pattern only demands "a compile-time constant" there
_BETA = np.float32(0.5)
_EPS = np.float32(1e-5)

_EXACT = ConstRule("value", rtol=0.0, atol=0.0)
_ISCLOSE = ConstRule("value", rtol=1e-5, atol=1e-8)  # np.isclose's defaults, as coremltools checks pow(0.5)


# -- coremltools' patterns ---------------------------------------------------------------------------------


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def layernorm_pattern_1(x):
    mean = mb.reduce_mean(x=x, axes=[2, 3], keep_dims=True, name="mean")
    sub = mb.sub(x=x, y=mean, name="sub")
    square = mb.square(x=sub, name="square")
    mean_sq = mb.reduce_mean(x=square, axes=[2, 3], keep_dims=True, name="mean_sq")
    add_eps = mb.add(x=mean_sq, y=_EPS, name="add_eps")
    rsqrt = mb.rsqrt(x=add_eps, name="rsqrt")
    mul_gamma = mb.mul(x=rsqrt, y=_GAMMA, name="mul_gamma")
    mul_x = mb.mul(x=x, y=mul_gamma, name="mul_x")
    mul_mean = mb.mul(x=mean, y=mul_gamma, name="mul_mean")
    sub_beta = mb.sub(x=_BETA, y=mul_mean, name="sub_beta")
    return mb.add(x=mul_x, y=sub_beta, name="add_out")


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def instancenorm_pattern_3(x):
    mean = mb.reduce_mean(x=x, axes=[2, 3], keep_dims=True, name="mean")
    sub = mb.sub(x=x, y=mean, name="sub")
    square = mb.square(x=sub, name="square")
    mean_sq = mb.reduce_mean(x=square, axes=[2, 3], keep_dims=True, name="mean_sq")
    add_eps = mb.add(x=mean_sq, y=_EPS, name="add_eps")
    rsqrt = mb.rsqrt(x=add_eps, name="rsqrt")
    mul_x = mb.mul(x=x, y=rsqrt, name="mul_x")
    mul_mean = mb.mul(x=mean, y=rsqrt, name="mul_mean")
    mul_neg = mb.mul(x=mul_mean, y=np.float32(-1.0), name="mul_neg")
    return mb.add(x=mul_x, y=mul_neg, name="add_out")


@mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
def instancenorm_pattern_4(x):
    mul_sq_x = mb.mul(x=x, y=x, name="mul_sq_x")
    sum_sq = mb.reduce_sum(x=mul_sq_x, axes=[2, 3], keep_dims=True, name="sum_sq")
    mean_sq = mb.mul(x=sum_sq, y=np.float32(0.25), name="mean_sq")
    sum_x = mb.reduce_sum(x=x, axes=[2, 3], keep_dims=True, name="sum_x")
    mean = mb.mul(x=sum_x, y=np.float32(0.25), name="mean")
    mul_sq_mean = mb.mul(x=mean, y=mean, name="mul_sq_mean")
    sub_var = mb.sub(x=mean_sq, y=mul_sq_mean, name="sub_var")
    add_eps = mb.add(x=sub_var, y=_EPS, name="add_eps")
    rsqrt = mb.rsqrt(x=add_eps, name="rsqrt")
    mul_gamma = mb.mul(x=rsqrt, y=_GAMMA, name="mul_gamma")
    mul_x = mb.mul(x=x, y=mul_gamma, name="mul_x")
    mul_mean = mb.mul(x=mean, y=mul_gamma, name="mul_mean")
    sub_beta = mb.sub(x=_BETA, y=mul_mean, name="sub_beta")
    return mb.add(x=mul_x, y=sub_beta, name="add_out")


def _pattern_5(affine: bool) -> Program:
    @mb.program(input_specs=[mb.TensorSpec(shape=_RANK4)])
    def pattern(x):
        mean = mb.reduce_mean(x=x, axes=[1], keep_dims=True, name="mean")
        sub = mb.sub(x=x, y=mean, name="sub")
        square = mb.mul(x=sub, y=sub, name="square")
        mean_sq = mb.reduce_mean(x=square, axes=[1], keep_dims=True, name="mean_sq")
        add_eps = mb.add(x=mean_sq, y=_EPS, name="add_eps")
        rsqrt = mb.rsqrt(x=add_eps, name="std")
        out = mb.mul(x=sub, y=rsqrt, name="normalize")
        if affine:
            out = mb.add(x=out, y=_BETA, name="add_beta")
            out = mb.mul(x=out, y=_GAMMA, name="mul_gamma")
        return out

    return pattern


layernorm_pattern_5_affine = _pattern_5(affine=True)
"""Pattern 5 with ml-ane-transformers' ``(norm + beta) * gamma``."""


# -- the written-out family --------------------------------------------------------------------------------

Subs = Literal["sub1", "sub2"]
Square = Literal["pow", "mul", "square"]
Normalizer = Literal["sqrt", "pow", "rsqrt"]
GammaAt = Literal["none", "before", "after"]
BetaAt = Literal["nobeta", "beta"]


def written_out_pattern(
    subs: Subs, square: Square, normalizer: Normalizer, gamma: GammaAt, beta: BetaAt
) -> Program:
    """Builds one member of the written-out family (see the module docstring for the diagram).

    Op names: ``mean``, ``sub``, ``square``, ``mean_sq``, ``add_eps``, ``std``, ``sub_num`` (sub2 only),
    ``mul_gamma`` (unless gamma is "none"), ``normalize``, ``add_beta`` (with beta).

    Args:
        subs: One ``x - mean`` for both branches, or a second one for the numerator.
        square: How ``d^2`` is written.
        normalizer: ``real_div`` by ``sqrt`` or ``pow(., 0.5)``, or ``mul`` by ``rsqrt``.
        gamma: No weight, weight applied to the numerator, or to the normalised value.
        beta: Whether a bias is added last.

    Returns:
        The pattern program.
    """

    @mb.program(input_specs=[mb.TensorSpec(shape=_RANK3)])
    def pattern(x):
        mean = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name="mean")
        sub = mb.sub(x=x, y=mean, name="sub")
        if square == "pow":
            sq = mb.pow(x=sub, y=np.float32(2.0), name="square")
        elif square == "mul":
            sq = mb.mul(x=sub, y=sub, name="square")
        else:
            sq = mb.square(x=sub, name="square")
        mean_sq = mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean_sq")
        add_eps = mb.add(x=mean_sq, y=_EPS, name="add_eps")
        if normalizer == "sqrt":
            std = mb.sqrt(x=add_eps, name="std")
        elif normalizer == "pow":
            std = mb.pow(x=add_eps, y=np.float32(0.5), name="std")
        else:
            std = mb.rsqrt(x=add_eps, name="std")
        num = sub if subs == "sub1" else mb.sub(x=x, y=mean, name="sub_num")
        if gamma == "before":
            num = mb.mul(x=_GAMMA, y=num, name="mul_gamma")
        if normalizer == "rsqrt":
            out = mb.mul(x=num, y=std, name="normalize")
        else:
            out = mb.real_div(x=num, y=std, name="normalize")
        if gamma == "after":
            out = mb.mul(x=_GAMMA, y=out, name="mul_gamma")
        if beta == "beta":
            out = mb.add(x=out, y=_BETA, name="add_beta")
        return out

    return pattern


_FAMILY_KEYS: list[tuple[Subs, Square, Normalizer, GammaAt, BetaAt]] = list(
    itertools.product(
        ("sub1", "sub2"),
        ("pow", "mul", "square"),
        ("sqrt", "pow", "rsqrt"),
        ("none", "before", "after"),
        ("nobeta", "beta"),
    )
)

WRITTEN_OUT_PATTERNS: dict[str, Program] = {"_".join(key): written_out_pattern(*key) for key in _FAMILY_KEYS}
"""Every member of the written-out family, by ``<subs>_<square>_<normalizer>_<gamma>_<beta>``."""

instancenorm_pattern_2 = WRITTEN_OUT_PATTERNS["sub2_square_pow_after_beta"]
"""coremltools' pattern 2: ``(x - mean) / pow(var + eps, 0.5) * gamma + beta``."""

layernorm_pattern_5 = WRITTEN_OUT_PATTERNS["sub1_mul_rsqrt_none_nobeta"]
"""coremltools' pattern 5 without gamma/beta: ``(x - mean) * rsqrt(var + eps)``."""


# -- what a match says, and which op it becomes: the semantic half, moved unchanged to
# generic_passes/_norm_plan.py (the rewrite changed only the patterns, which this module keeps); imported
# at the top of this module.

# -- registration --------------------------------------------------------------------------------------------


def _size(program: Program) -> int:
    return sum(op.op_type != "const" for op in program.functions["main"].operations)


def _register(
    program: Program,
    constraints: Callable[[Pattern], bool],
    name: str,
    const_rules: dict[str, ConstRule] | None = None,
    namespace: str = "reference",
) -> None:
    # Longer patterns first: a pattern that is a prefix of another (pattern 5 without its affine tail,
    # the family without gamma or beta) must not take the ops the longer one would fuse.
    register_generic_pass(
        ops_arrangement=program,
        var_constraints=constraints,
        transform_pattern=transform_norm,
        pass_name=PASS_NAME,
        namespace=namespace,
        constants="const",
        const_rules=const_rules,
        priority=_size(program),
        name=name,
    )


def register(namespace: str = "reference") -> str:
    """Registers the 112 sub-passes under ``<namespace>::fuse_layernorm_or_instancenorm``; returns the id."""
    _register(layernorm_pattern_1, _constraints_1, "pattern_1", None, namespace)
    _register(instancenorm_pattern_3, _constraints_3, "pattern_3", {"mul_neg.y": _EXACT}, namespace)
    _register(instancenorm_pattern_4, _constraints_4, "pattern_4", None, namespace)
    _register(layernorm_pattern_5_affine, _constraints_5_affine, "pattern_5_affine", None, namespace)
    for _key in _FAMILY_KEYS:
        _rules = {}
        if _key[1] == "pow":
            _rules["square.y"] = _EXACT  # pow(d, 2.0000001) is NaN for d < 0
        if _key[2] == "pow":
            _rules["std.y"] = _ISCLOSE
        _register(
            WRITTEN_OUT_PATTERNS["_".join(_key)],
            _constraints_written_out,
            "written_out_" + "_".join(_key),
            _rules,
            namespace,
        )
    return f"{namespace}::{PASS_NAME}"


def shadow(container: Any, log_path: str) -> None:
    """Makes ``container`` (the pass under test) also run this reference on a copy of every program it
    is applied to, from the same builder name counters, and compare the printed programs: each
    comparison appends ``same`` or ``DIFF`` and the pass id to ``log_path``; a difference raises
    AssertionError with both programs (``PATTERN_INFRA_SHADOW_LAYERNORM=<log>``, ``tests/conftest.py``)."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    from pattern_infra.authoring.clone import clone_program

    pass_id = f"reference::{PASS_NAME}"
    if pass_id not in PASS_REGISTRY.passes:
        register()
    reference = PASS_REGISTRY.passes[pass_id]
    apply = container.apply

    def compared(prog: Program) -> None:
        before = clone_program(prog)
        start = dict(mb.name_count)
        apply(prog)
        end = dict(mb.name_count)
        mb.name_count.clear()
        mb.name_count.update(start)
        try:
            reference.apply(before)
        finally:
            mb.name_count.clear()
            mb.name_count.update(end)
        same = str(before) == str(prog)
        with open(log_path, "a") as log:
            log.write(f"{'same' if same else 'DIFF'} {container.pass_id}\n")
        if not same:
            raise AssertionError(
                f"{container.pass_id} differs from its reference:\nreference:\n{before}\nours:\n{prog}"
            )

    container.apply = compared
