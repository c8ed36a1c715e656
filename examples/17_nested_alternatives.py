"""Alternatives at any point of a pattern: ``one_of`` and ``optional``.

RMSNorm is written in many ways: the square as ``x * x`` or ``pow(x, 2)``; the normalisation as
``x * rsqrt(v)``, ``x / sqrt(v)`` or ``x * (1 / sqrt(v))``; with or without a weight. That is
2 x 3 x 2 = 12 programs, and 12 patterns if each spelling needed its own. With ``one_of`` the pattern
declares each choice where it occurs, and stays one pattern::

    x --> one_of{mul(x, x) | pow(x, 2)} --> reduce_mean --> add(eps) = v
    |                                                                 |
    +--> optional{ one_of{mul(x, rsqrt(v)) | real_div(x, sqrt(v)) | mul(x, real_div(1, sqrt(v)))}
                   [--> mul(w)] } --> y
    becomes   x --> mul(x, rsqrt(reduce_mean(mul(x, x)) + eps)) [--> mul(w)] --> y   (one canonical spelling)

Each of the 12 spellings is compiled as a plain pattern when the pattern compiles; the search merges
their plans into one tree, so what they share is searched once and a choice costs a branch. Shown: the
pattern's spellings, a program with all 12 of them, each matched once with the alternatives that
matched, the rewrite and numerical equality, and ``explain`` on a spelling no alternative covers.
"""

import _common as ex
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import compile_pattern, explain, find_matches, register_generic_pass
from pattern_infra.language.choices import one_of, optional


def normed(x, v):
    return one_of(
        "normed",
        lambda: mb.mul(x=x, y=mb.rsqrt(x=v, name="inv"), name="scale"),
        lambda: mb.real_div(x=x, y=mb.sqrt(x=v, name="root"), name="scale"),
        lambda: mb.mul(x=x, y=mb.real_div(x=1.0, y=mb.sqrt(x=v, name="root"), name="inv"), name="scale"),
    )


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), 8)), mb.TensorSpec(shape=(8,))])
def rms_norm(x, w):
    sq = one_of("square", lambda: mb.mul(x=x, y=x, name="sq"), lambda: mb.pow(x=x, y=2.0, name="sq"))
    v = mb.add(x=mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var")
    return optional("weighted", lambda: normed(x, v), lambda n: mb.mul(x=n, y=w, name="weight"))


ex.banner("1. one pattern, three choices")
compiled = compile_pattern(rms_norm, name="rms_norm")
for variant in compiled.variants:
    print(f"{dict(variant.choices)}: " + ", ".join(node.name for node in variant.compiled.nodes))
ex.check(len(compiled.variants) == 12, "12 spellings (2 squares x 3 norms x with or without the weight)")

SQUARES = [lambda x: mb.mul(x=x, y=x), lambda x: mb.pow(x=x, y=2.0)]
NORMS = [
    lambda x, v: mb.mul(x=mb.rsqrt(x=v), y=x),
    lambda x, v: mb.real_div(x=x, y=mb.sqrt(x=v)),
    lambda x, v: mb.mul(x=x, y=mb.real_div(x=1.0, y=mb.sqrt(x=v))),
]


@mb.program(input_specs=[mb.TensorSpec(shape=(3, 8)), mb.TensorSpec(shape=(8,))])
def twelve(x, w):
    outs = []
    for square in SQUARES:
        for norm in NORMS:
            for weighted in (True, False):
                v = mb.add(x=mb.reduce_mean(x=square(x), axes=[-1], keep_dims=True), y=1e-6)
                y = norm(x, v)
                outs.append(mb.mul(x=y, y=w) if weighted else y)
    return tuple(outs)


ex.banner("2. the twelve spellings, each matched once")
matches = list(find_matches(rms_norm, twelve, constants="const"))
for m in matches:
    print(
        f"  {m.final_op.name:>8}: choices {m.choices}, weight {'yes' if m.root_vars[1] is not None else 'no'}"
    )
ex.check(
    len(matches) == 12 and len({tuple(sorted(m.choices.items())) for m in matches}) == 12,
    "12 matches, 12 different combinations of alternatives",
)


def to_rms(pattern):
    if pattern.choices["square"] == 0 and pattern.choices["normed"] == 0:
        return False  # already the canonical spelling: decline (else the pass would rewrite it forever)
    x, w, last = pattern.root_vars[0], pattern.root_vars[1], pattern.final_op
    eps = pattern.operand("var", "y")
    ms = mb.reduce_mean(x=mb.mul(x=x, y=x, before_op=last), axes=[-1], keep_dims=True, before_op=last)
    y = mb.mul(x=x, y=mb.rsqrt(x=mb.add(x=ms, y=eps, before_op=last), before_op=last), before_op=last)
    if w is not None:
        y = mb.mul(x=y, y=w, before_op=last)
    pattern.replace_output(y)


rms_pass = register_generic_pass(rms_norm, None, to_rms, "canonical_rms_norm", "examples", constants="const")
ex.banner("3. rewritten into one canonical spelling")
after = ex.rewrite(rms_pass, twelve)
ex.check(
    ex.op_types(after).count("rsqrt") == 12
    and "sqrt" not in ex.op_types(after)
    and "pow" not in ex.op_types(after),
    "every spelling became mul / rsqrt",
)
ex.compare(twelve, after, tol=1e-6)


@mb.program(input_specs=[mb.TensorSpec(shape=(3, 8))])
def exp_spelling(x):
    v = mb.add(x=mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[-1], keep_dims=True), y=1e-6)
    return mb.mul(x=x, y=mb.exp(x=v))


ex.banner("4. explain: a spelling no alternative covers")
report = explain(rms_norm, exp_spelling)
print(report)
ex.check(
    "normed = mul(x, rsqrt(var))" in str(report) and "stopped at 'inv'" in str(report),
    "explain names the spelling tried (its alternative of 'normed') and where the nearest miss stopped",
)
