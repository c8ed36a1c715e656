"""``explain``'s report reads for a user: counts over the spelling tried, no near miss where the pattern
matched, one name per op, reasons without the search's own words, spellings named by their alternatives."""

from __future__ import annotations

import re

import pytest
from coremltools.converters.mil import Builder as mb

import generic_passes  # noqa: F401  (registers the passes)
from pattern_infra import explain
from pattern_infra.language.choices import one_of

INTERNAL = ("already found", "collected", "inside a longer", "further down", "unmatched", "alternative 0")
"""Phrases of the search's own bookkeeping, never shown to a user."""


def _count_lines(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"near miss: (\d+)/(\d+) ops", text)]


def _check_readable(report) -> None:
    text = str(report)
    for explanation in report if isinstance(report, list) else [report]:
        taken = {op.name for m in explanation.matches for op in _ops(m)}
        for miss, (_, size) in zip(explanation.near_misses, explanation.spellings, strict=True):
            assert miss.bound == len(miss.ops) <= size, (miss, size)
            assert not taken & set(miss.ops.values()), (miss, taken)
            assert len(set(miss.ops.values())) == len(miss.ops), miss
    assert all(bound <= size for bound, size in _count_lines(text)), text
    for phrase in INTERNAL:
        assert phrase not in text, (phrase, text)
    for line in text.splitlines():
        if line.strip().startswith("match:"):
            names = [pair.split("=")[1] for pair in line.split(": ", 1)[1].split(", ")]
            assert len(names) == len(set(names)), line


def _ops(match):
    for op in match.ops.values():
        yield from op if isinstance(op, list) else [op]


@pytest.fixture(scope="module")
def transformer():
    from pattern_infra.testing.convert import convert_torch_model
    from pattern_infra.testing.models import ZOO

    module, args = ZOO["prenorm_transformer"]()
    return convert_torch_model(module, args, override=False)._mil_program


def test_the_layer_norm_pass_on_the_prenorm_transformer_reads_for_a_user(transformer):
    report = explain("common::fuse_layernorm_or_instancenorm", transformer)
    _check_readable(report)
    text = str(report)
    written = next(e for e in report if e.pattern == "written_out_sub1_pow_or_square")
    assert len(written.matches) == 5
    # a spelling of several is named by its number and the alternative it takes at each choice
    assert re.search(r"ops of spelling \d+ of 36 \(squared = ", text), text
    assert "square=pow_1" in text and "squared=pow_1" not in text
    # each pattern is named after its program (what it is), not by a bare number
    assert not re.search(r"pattern 'pattern_\d", text), text
    assert "pattern 'layernorm_pattern_1'" in text and "pattern 'instancenorm_pattern_4'" in text


@mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
def _square_relu(x):
    sq = one_of("squared", lambda: mb.mul(x=x, y=x, name="sq"), lambda: mb.square(x=x, name="sq"))
    return mb.relu(x=mb.exp(x=sq, name="e"), name="r")


def test_a_full_match_has_no_near_miss_and_each_op_one_name():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def prog(x):
        return mb.relu(x=mb.exp(x=mb.square(x=x)))

    report = explain(_square_relu, prog, top=10)
    assert len(report.matches) == 1
    assert report.near_misses == []
    _check_readable(report)
    assert str(report).count("square_0") == 1, str(report)


def test_a_near_miss_counts_over_its_spelling_and_names_it():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def prog(x):
        return mb.relu(x=mb.sigmoid(x=mb.square(x=x)))

    report = explain(_square_relu, prog, top=10)
    _check_readable(report)
    text = str(report)
    assert not report.matches and report.near_misses, text
    assert all(size == 3 for _, size in report.spellings), report.spellings
    assert "of spelling 1 of 2 (squared = " in text or "of spelling 2 of 2 (squared = " in text, text
    assert "pattern wants exp, program has sigmoid" in text, text


def test_a_missing_consumer_is_said_in_a_users_words():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 4))])
    def prog(x):
        return mb.exp(x=mb.mul(x=x, y=x))

    text = str(explain(_square_relu, prog, top=10))
    assert "no other consumer of" in text and "is a relu op" in text, text
    _check_readable(explain(_square_relu, prog, top=10))
