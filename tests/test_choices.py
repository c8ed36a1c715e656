"""Alternatives at any point of a pattern (``one_of``, ``optional``): compiling and matching."""

from __future__ import annotations

import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol

from pattern_infra import (
    PatternDefinitionError,
    compile_pattern,
    explain,
    find_matches,
    register_generic_pass,
)
from pattern_infra.language.choices import one_of, optional

ROW = [mb.TensorSpec(shape=(get_new_symbol(), 8))]
ROW_AND_WEIGHT = ROW + [mb.TensorSpec(shape=(8,))]


def normed(x, v):
    return one_of(
        "normed",
        lambda: mb.mul(x=x, y=mb.rsqrt(x=v, name="inv"), name="scale"),
        lambda: mb.real_div(x=x, y=mb.sqrt(x=v, name="root"), name="scale"),
        lambda: mb.mul(x=x, y=mb.real_div(x=1.0, y=mb.sqrt(x=v, name="root"), name="inv"), name="scale"),
    )


@mb.program(input_specs=ROW_AND_WEIGHT)
def rms_norm(x, w):
    sq = one_of("square", lambda: mb.mul(x=x, y=x, name="sq"), lambda: mb.pow(x=x, y=2.0, name="sq"))
    v = mb.add(x=mb.reduce_mean(x=sq, axes=[-1], keep_dims=True, name="mean"), y=1e-6, name="var")
    return optional("weighted", lambda: normed(x, v), lambda n: mb.mul(x=n, y=w, name="weight"))


# -- compiling --------------------------------------------------------------------------------------------


def test_every_spelling_is_a_plain_pattern_and_the_anchors_are_what_they_share():
    from pattern_infra.matching.matcher import Matcher

    compiled = compile_pattern(rms_norm, name="rms_norm")
    variants = compiled.variants
    assert len(variants) == 2 * (3 + 3)  # square x (weighted: normed with the weight, or normed alone)
    assert [n.name for n in variants[0].compiled.nodes] == ["sq", "mean", "var", "inv", "scale", "weight"]
    assert [n.name for n in variants[-1].compiled.nodes] == ["sq", "mean", "var", "root", "inv", "scale"]
    assert all(not v.compiled.variants or v.compiled is compiled for v in variants)
    # the anchors: the ops outside every choice and the top-level choices, accepting every spelling's type
    anchors = Matcher(compiled).nodes
    assert [a.name for a in anchors] == ["square", "mean", "var", "weighted"]
    assert anchors[0].op_types == {"mul", "pow"} and anchors[3].op_types == {"mul", "real_div"}
    # pattern.choices, with the operand holding each slot of each choice taken
    last = variants[-1].choices
    assert dict(last) == {"square": 1, "weighted": 1, "normed": 2}
    assert last.slots["normed"] == {"x": ("scale", "x", -1), "var": ("root", "x", -1)}
    assert last.slots["weighted"] == {"var": ("root", "x", -1), "x": ("scale", "x", -1)}
    # each op knows its innermost choice and the alternative taken there, in words
    assert variants[0].within["sq"] == ("square", "mul(x, x)")
    assert [v.within["scale"][1] for v in variants[:3]] == [
        "mul(x, rsqrt(var))",
        "real_div(x, sqrt(var))",
        "mul(x, real_div(1, sqrt(var)))",
    ]
    # the longest spelling wins: without the weight, a guard searches the weighted alternative below
    (guard,) = variants[3].guards
    assert (guard.choice, guard.alternative, guard.end) == ("weighted", 1, "scale")
    assert guard.depth == 4 and guard.output_types == {"mul"}  # weight <- scale <- real_div <- sqrt
    assert [len(v.compiled.nodes) for v in guard.earlier[0].variants] == [3, 3, 4]  # normed, then the weight


def _build(body):
    return mb.program(input_specs=ROW)(body)


@pytest.mark.parametrize(
    "body, message",
    [
        (lambda x: one_of("c", lambda: mb.relu(x=x, name="r"), lambda: x), "alternative 1 returns x"),
        (
            lambda x: one_of("c", lambda: mb.relu(x=x, name="r"), lambda: mb.const(val=1.0, name="k")),
            "none of its own ops computes",
        ),
        (lambda x: one_of("c", lambda: mb.relu(x=x, name="r")), "at least two alternatives"),
        (lambda x: one_of("not ok", lambda: mb.relu(x=x), lambda: mb.exp(x=x)), "Python identifier"),
    ],
    ids=["returns-an-input", "returns-a-constant", "one-alternative", "bad-name"],
)
def test_bad_alternatives_are_refused_with_the_rule_and_the_fix(body, message):
    with pytest.raises(PatternDefinitionError, match=message) as info:
        _build(body)
    assert "Fix" in str(info.value) or "must" in str(info.value) or "needs" in str(info.value)


def test_an_alternative_returning_a_variable_built_elsewhere_is_refused():
    def body(x):
        r = mb.relu(x=x, name="r")
        return one_of("c", lambda: mb.exp(x=r, name="e"), lambda: r)

    with pytest.raises(PatternDefinitionError, match="Rule: every alternative produces"):
        _build(body)


def test_one_of_outside_a_pattern_program_is_refused():
    with pytest.raises(PatternDefinitionError, match="while an @mb.program pattern is built"):
        one_of("c", lambda: None, lambda: None)


@pytest.mark.parametrize(
    "body, message",
    [
        (lambda x: _reads_other_alternative(x), "built by alternative 0"),
        (lambda x: _outer_op_read_by_one_alternative(x), "not by alternative"),
        (lambda x: _name_clash(x), "also used outside the choice"),
        (lambda x: _inner_var_used_outside(x), "Only the choice's own variable"),
    ],
    ids=["reads-another-alternative", "outer-op-in-one-alternative", "name-clash", "inner-var-outside"],
)
@pytest.mark.parametrize("equivalences", [False, True])
def test_choice_rules_at_compile_time(body, message, equivalences):
    with pytest.raises(PatternDefinitionError, match=message):
        compile_pattern(_build(body), equivalences=equivalences)


def _reads_other_alternative(x):
    shared = []

    def first():
        shared.append(mb.relu(x=x, name="r"))
        return mb.exp(x=shared[0], name="e")

    return one_of("c", first, lambda: mb.sigmoid(x=shared[0], name="s"))


def _outer_op_read_by_one_alternative(x):
    r = mb.relu(x=x, name="r")
    return one_of("c", lambda: mb.exp(x=r, name="e"), lambda: mb.exp(x=x, name="e"))


def _name_clash(x):
    r = mb.relu(x=x, name="r")
    return one_of("c", lambda: mb.exp(x=r, name="r2"), lambda: mb.sigmoid(x=mb.tanh(x=r, name="r"), name="s"))


def _inner_var_used_outside(x):
    inner = []

    def first():
        inner.append(mb.pow(x=x, y=2.0, name="r"))  # an op equivalences= spells two ways
        return mb.exp(x=inner[0], name="e")

    c = one_of("c", first, lambda: mb.sigmoid(x=x, name="s"))
    return mb.add(x=c, y=inner[0], name="a")


# -- matching ---------------------------------------------------------------------------------------------

SQUARES = {"mul": lambda x: mb.mul(x=x, y=x), "pow": lambda x: mb.pow(x=x, y=2.0)}
NORMALIZERS = {
    "rsqrt": lambda x, v: mb.mul(x=mb.rsqrt(x=v), y=x),  # operands in the other order than the pattern
    "div_sqrt": lambda x, v: mb.real_div(x=x, y=mb.sqrt(x=v)),
    "inv_sqrt": lambda x, v: mb.mul(x=x, y=mb.real_div(x=1.0, y=mb.sqrt(x=v))),
}
SPELLINGS = [(s, n, w) for s in SQUARES for n in NORMALIZERS for w in (True, False)]


def rms_program(square, normalizer, weighted, extra_consumer=False):
    specs = (
        [mb.TensorSpec(shape=(3, 8)), mb.TensorSpec(shape=(8,))]
        if weighted
        else [mb.TensorSpec(shape=(3, 8))]
    )

    def body(x, w=None):
        v = mb.add(x=mb.reduce_mean(x=SQUARES[square](x), axes=[-1], keep_dims=True), y=1e-6)
        out = NORMALIZERS[normalizer](x, v)
        if weighted:
            out = mb.mul(x=w, y=out)
        if extra_consumer:
            return out, mb.relu(x=v)
        return out

    if weighted:
        return mb.program(input_specs=specs)(lambda x, w: body(x, w))
    return mb.program(input_specs=specs)(lambda x: body(x))


def test_twelve_spellings_of_rms_norm_are_twelve_programs():
    assert len(SPELLINGS) == 12

    def structure(prog):  # each op with the types of what it reads
        ops = [op for op in prog.functions["main"].operations if op.op_type != "const"]
        return tuple(
            (
                op.op_type,
                tuple(
                    v.op.op_type if v.op is not None else "input"
                    for v in op.inputs.values()
                    if not isinstance(v, (list, tuple))
                ),
            )
            for op in ops
        )

    assert len({structure(rms_program(*s)) for s in SPELLINGS}) == 12


@pytest.mark.parametrize("spelling", SPELLINGS, ids=["-".join(map(str, s)) for s in SPELLINGS])
def test_one_pattern_matches_every_spelling_of_rms_norm(spelling):
    square, normalizer, weighted = spelling
    prog = rms_program(*spelling)
    (match,) = find_matches(rms_norm, prog, constants="const")
    main = prog.functions["main"]
    ops = [op for op in main.operations if op.op_type != "const"]
    assert match.final_op is ops[-1] and set(match.op_set) == set(ops)
    assert match.root_vars[0] is main.inputs["x"]
    assert match.root_vars[1] is (main.inputs["w"] if weighted else None)
    expected_normed = list(NORMALIZERS).index(normalizer)
    assert match.choices == {
        "square": list(SQUARES).index(square),
        "weighted": 0 if weighted else 1,
        "normed": expected_normed,
    }
    assert match.sq.op_type == square and match.square is match.sq
    assert match.weighted is ops[-1]


def test_every_spelling_matches_once_with_its_own_choices():
    for spelling in SPELLINGS:
        (match,) = find_matches(rms_norm, rms_program(*spelling))
        assert match.choices["weighted"] == (0 if spelling[2] else 1)


def test_a_choices_name_is_the_op_of_its_alternative_in_every_view_of_the_match():
    """``pattern.<choice>`` is the last op of the alternative that matched (through a nested choice's), and
    so is ``pattern.ops[<choice>]`` (right after that alternative's ops); the choice's operands
    (``pattern.operand``) are the operands of its alternative's ops that read them, located by the
    spelling (``pattern_infra.language.spelling``): ``pattern.choices``, shared by the matches of one
    spelling, so read-only; ``add_attribute`` refuses a choice's name. On every spelling."""

    def views(spelling):
        prog = rms_program(*spelling)
        main = prog.functions["main"]
        (m,) = find_matches(rms_norm, prog, constants="const")
        last = m.weight if spelling[2] else m.scale
        assert m.weighted is last and m.normed is m.scale and m.square is m.sq
        names = list(m.ops)
        assert names.index("sq") < names.index("square") < names.index("mean")
        assert names.index("scale") < names.index("normed") and names[-1] == "weighted"
        assert m.ops["weighted"] is last and m.ops["normed"] is m.scale and m.final_op is last
        assert m.operand("weighted", "x") is main.inputs["x"] and m.operand("square", "x") is main.inputs["x"]
        assert m.operand("normed", "var") is m.var.outputs[0]
        assert (
            (m.operand("weighted", "w") is main.inputs["w"])
            if spelling[2]
            else len(m.op_set) == len(names) - 3
        )
        assert f"weighted={last.name}" in repr(m)
        with pytest.raises(TypeError, match=r"dict\(pattern.choices\)"):
            m.choices["square"] = 1
        with pytest.raises(NameError, match="overwrite"):
            m.add_attribute("normed", 1)
        with pytest.raises(KeyError, match="normed"):
            m.operand("normed", "w")
        with pytest.raises(AttributeError, match="no_such_op"):
            m.no_such_op  # noqa: B018
        return names, dict(m.choices)

    for spelling in SPELLINGS:
        views(spelling)


def test_a_choice_keeps_its_operands_where_an_op_has_a_choices_name():
    """An op with ``equivalences=`` inside an alternative is a choice named as its own ops: such a
    pattern's matches hold their choices' operands, the outer choice's too."""

    @mb.program(input_specs=ROW)
    def pattern(x):
        act = one_of(
            "act",
            lambda: mb.relu(x=mb.pow(x=x, y=2.0, name="sq"), name="r"),
            lambda: mb.sigmoid(x=x, name="s"),
        )
        return mb.add(x=act, y=1.0, name="out")

    @mb.program(input_specs=ROW)
    def prog(x):
        return mb.add(x=mb.relu(x=mb.mul(x=x, y=x)), y=1.0)

    def found():
        (m,) = find_matches(pattern, prog, equivalences={"sq": ["pow2"]})
        assert m.choices == {"act": 0, "sq": 1} and m.act is m.r
        x = prog.functions["main"].inputs["x"]
        assert m.operand("act", "x") is x and m.operand("sq", "x") is x
        assert m.operand("out", "x") is m.r.outputs[0] and m.operand("r", "x") is m.sq.outputs[0]
        return sorted(m.ops)

    assert found() == ["act", "out", "r", "sq"]


def test_an_intermediate_inside_an_alternative_used_elsewhere_blocks_the_match():
    prog = rms_program("mul", "div_sqrt", True, extra_consumer=True)
    assert list(find_matches(rms_norm, prog)) == []


def test_explain_lists_the_alternatives_tried():

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 8))])
    def prog(x):
        v = mb.add(x=mb.reduce_mean(x=mb.mul(x=x, y=x), axes=[-1], keep_dims=True), y=1e-6)
        return mb.mul(x=x, y=mb.exp(x=v))  # exp: no alternative of "normed" has it

    text = str(explain(rms_norm, prog))
    assert "of spelling 1 of 12 (square = mul(x, x); normed = mul(x, rsqrt(var));" in text, text


def test_an_outer_op_read_twice_by_an_alternative_is_counted_so():
    @mb.program(input_specs=ROW)
    def twice(x):
        r = mb.relu(x=x, name="r")
        return one_of(
            "c", lambda: mb.mul(x=r, y=r, name="m"), lambda: mb.pow(x=mb.abs(x=r, name="a"), y=2.0, name="m")
        )

    with pytest.raises(PatternDefinitionError, match="different number of times"):
        compile_pattern(twice)

    @mb.program(input_specs=ROW)
    def both_twice(x):
        r = mb.relu(x=x, name="r")
        return one_of("c", lambda: mb.mul(x=r, y=r, name="m"), lambda: mb.add(x=r, y=r, name="m"))

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        r = mb.relu(x=x)
        return mb.add(x=r, y=r)

    (match,) = find_matches(both_twice, prog)
    assert match.choices == {"c": 1} and match.r.op_type == "relu"


def test_matching_cost_does_not_grow_with_the_number_of_spellings():
    """Bind attempts (the matcher's deterministic unit of work) of the 12-spelling pattern against the
    one spelling written out, on a program of that spelling: within 2x (bench.choices has the times). The
    spellings share the plan tree's prefix; what is added is the spelling without the weight, tried after
    the weighted one at the same ops, and its longest-spelling guard (the weighted alternative searched
    below it): 11 against 6, where one search per spelling would make 12 times the prefix."""
    from pattern_infra import Matcher
    from pattern_infra.authoring.find import find_in_program

    spelling = SPELLINGS[0]
    prog = rms_program(*spelling)
    one = rms_program(*spelling)
    for op in one.functions["main"].operations:
        op.name = f"p_{op.name}"
    costs = []
    for pattern in (rms_norm, one):
        matcher = Matcher(compile_pattern(pattern, constants="const"))
        assert len(list(find_in_program(prog, matcher))) == 1
        costs.append(matcher.stats.bind_attempts)
    assert costs[1] == 6 and costs[0] <= 2 * costs[1], costs


@pytest.mark.parametrize("k", [2, 12])
def test_the_alternatives_of_one_choice_point_add_no_bind_attempt(k):
    """One choice point of ``k`` unary ops between two plain ops (bench.choices' table 2), a pass's search
    on instances of the first alternative and of the last: as many bind attempts per match as the op
    written out, however many alternatives come before the one that matches (the dispatch on the op
    type passes over them), and the alternative that matched is the one of the op's type."""
    from bench.choices import ACTIVATIONS, activation_chain, activation_pattern, first_matches
    from pattern_infra import Matcher
    from pattern_infra.authoring.find import find_in_program

    for index in (0, k - 1):
        prog = activation_chain(ACTIVATIONS[index], 5)
        choice, written = (
            Matcher(compile_pattern(pattern, constants="const"))
            for pattern in (activation_pattern(k), activation_pattern(1, ACTIVATIONS[index]))
        )
        assert first_matches(choice, prog) == first_matches(written, prog) == 5
        assert choice.stats.bind_attempts == written.stats.bind_attempts, (
            index,
            choice.stats.bind_attempts,
            written.stats.bind_attempts,
        )
        matches = list(find_in_program(prog, choice))
        assert [(m.choices, m.act.op_type) for m in matches] == [({"act": index}, ACTIVATIONS[index])] * 5


@pytest.mark.parametrize("fallback", [False, True])
def test_fallback_offers_the_shorter_spelling_when_the_longer_is_refused(fallback):
    """With ``fallback=True`` a match refused by the constraints with the optional op is offered again
    without it (the op then stays outside the match); by default the shorter spelling is never matched
    inside the longer one."""

    @mb.program(input_specs=ROW_AND_WEIGHT)
    def pattern(x, w):
        v = mb.add(
            x=mb.reduce_mean(x=mb.mul(x=x, y=x, name="sq"), axes=[-1], keep_dims=True, name="mean"),
            y=1e-6,
            name="var",
        )
        return optional(
            "weighted",
            lambda: mb.mul(x=x, y=mb.rsqrt(x=v, name="inv"), name="scale"),
            lambda n: mb.mul(x=n, y=w, name="weight"),
            fallback=fallback,
        )

    prog = rms_program("mul", "rsqrt", True)
    refuse_weight = lambda match: "weight" not in match.ops  # noqa: E731
    found = list(find_matches(pattern, prog, var_constraints=refuse_weight))
    assert [m.choices for m in found] == ([{"weighted": 1}] if fallback else [])
    # Unconstrained, the longer spelling is taken: find_matches reports what the pass would rewrite, not
    # the shorter spelling inside it as well.
    unconstrained = list(find_matches(pattern, prog))
    assert [m.choices for m in unconstrained] == [{"weighted": 0}]
    assert [m.choices for m in explain(pattern, prog).matches] == [{"weighted": 0}]


def test_an_op_every_alternative_has_is_not_an_anchor():
    """Anchors are the ops outside the choices and the choices themselves: an op that every alternative of
    a choice builds alike is inside the choice, so a ``fallback`` guard means the same from every anchor."""
    from pattern_infra.matching.matcher import Matcher

    @mb.program(input_specs=ROW)
    def shared_inner(x):
        return one_of(
            "c",
            lambda: mb.exp(x=mb.relu(x=x, name="r"), name="e"),
            lambda: mb.sigmoid(x=mb.relu(x=x, name="r"), name="s"),
        )

    matcher = Matcher(compile_pattern(shared_inner))
    assert "r" in matcher.places and [a.name for a in matcher.nodes] == ["c"]
    assert matcher.nodes[0].op_types == {"exp", "sigmoid"}


def test_choices_come_last_in_the_plans():
    """A search that fails on the plain ops never searches the alternatives: in both tanh-GELU patterns,
    on every path of the plan tree from every anchor but the cube (a choice), the cube's ops come last."""
    import generic_passes  # noqa: F401  (registers the passes)
    from pattern_infra import generic_passes as registered
    from pattern_infra.matching.plan import Leaf

    def paths(items, steps=()):
        for item in items:
            if isinstance(item, Leaf):
                yield steps, item
            else:
                yield from paths(item.then, (*steps, item.step.node))

    container = registered()["common::fuse_gelu_tanh_approximation"]
    for sub in container.passes:
        matcher = sub.matcher
        for anchor in matcher.nodes:
            if anchor.name != "cube":
                for steps, leaf in paths(matcher.trees[anchor.index]):
                    inside = [matcher.ops[n].name in matcher.variants[leaf.variant].groups for n in steps]
                    assert any(inside) and inside == sorted(inside), (sub.name, anchor.name, steps)


def test_one_of_with_equivalences_rewrites_the_first_match():
    """A choice whose alternatives hold ops that equivalences turn into choices of their own: the match
    is built and rewritten (it once crashed building the match's dicts)."""

    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),))])
    def pat(x):
        return one_of(
            "o",
            lambda: mb.mul(x=x, y=mb.sigmoid(x=x, name="s"), name="o"),
            lambda: mb.mul(x=x, y=mb.add(x=x, y=1.0, name="a"), name="o"),
        )

    @mb.program(input_specs=[mb.TensorSpec(shape=(4,))])
    def prog(x):
        return mb.relu(x=mb.mul(x=x, y=mb.sigmoid(x=x)))

    def transform(pattern):
        silu = mb.silu(x=pattern.root_var, name=pattern.o.outputs[0].name, before_op=pattern.o)
        pattern.replace_output(silu)

    register_generic_pass(pat, None, transform, "silu", "test_choices_equivalences", equivalences=True)(prog)
    assert [op.op_type for op in prog.functions["main"].operations] == ["silu", "relu"]


def test_a_pattern_of_more_than_256_spellings_is_refused_with_the_rule_and_the_fix(namespace):
    @mb.program(input_specs=ROW)
    def nine_choices(x):
        for i in range(9):
            x = one_of(
                f"c{i}",
                lambda x=x, i=i: mb.relu(x=x, name=f"r{i}"),
                lambda x=x, i=i: mb.sigmoid(x=x, name=f"s{i}"),
            )
        return x

    with pytest.raises(
        PatternDefinitionError, match=r"stands for 512 spellings .* at most 256 .* separate patterns"
    ):
        compile_pattern(nine_choices)
    with pytest.raises(PatternDefinitionError, match="stands for 512 spellings"):
        register_generic_pass(nine_choices, None, lambda p: None, "nine", namespace)
