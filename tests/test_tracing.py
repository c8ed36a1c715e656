"""The trace of every rewrite: what it records, that it is plain data, and that it costs nothing closed."""

from __future__ import annotations

import json

from coremltools.converters.mil import Builder as mb

import pattern_infra
from pattern_infra import register_generic_pass
from pattern_infra.inspecting import tracing
from pattern_infra.testing.passes import relu_exp, to_softplus


def two_instances():
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        a = mb.exp(x=mb.relu(x=x, name="r1"), name="e1")
        b = mb.exp(x=mb.relu(x=a, name="r2"), name="e2")
        return mb.sin(x=b, name="s")

    return prog


def test_each_rewrite_is_recorded_with_names_and_block(namespace):
    container = register_generic_pass(relu_exp, None, to_softplus, "softplus", namespace)
    prog = two_instances()
    with pattern_infra.trace() as rewrites:
        container(prog)
    assert [r.matched for r in rewrites] == [["r1", "e1"], ["r2", "e2"]]
    assert [r.replaced_by for r in rewrites] == [["e1"], ["e2"]]  # the softplus takes the exp's name
    assert [sorted(r.removed) for r in rewrites] == [["e1", "r1"], ["e2", "r2"]]
    first = rewrites[0]
    assert (first.pass_id, first.pattern, first.function) == (f"{namespace}::softplus", "e", "main")
    assert first.block == prog.functions["main"].name
    assert [(op.name, op.type, op.inputs) for op in first.before] == [
        ("r1", "relu", ["x"]),
        ("e1", "exp", ["r1"]),
    ]
    assert [(op.name, op.type, op.inputs) for op in first.after] == [("e1", "softplus", ["x"])]


def test_trace_is_json_serialisable_and_round_trips(namespace):
    container = register_generic_pass(relu_exp, None, to_softplus, "softplus", namespace)
    with pattern_infra.trace() as rewrites:
        container(two_instances())
    data = json.loads(json.dumps(rewrites.to_dicts()))
    assert len(data) == 2
    assert data[0]["matched"] == ["r1", "e1"]
    assert data[0]["before"][0] == {
        "name": "r1",
        "type": "relu",
        "inputs": ["x"],
        "outputs": ["r1"],
        "consts": {},
    }


def test_constants_are_recorded_by_value(namespace):
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def scaled(x):
        return mb.relu(x=mb.mul(x=x, y=2.0, name="m"), name="r")

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))])
    def prog(x):
        return mb.sin(x=mb.relu(x=mb.mul(x=x, y=2.0, name="m"), name="r"))

    def to_softplus_of_mul(pattern):
        pattern.replace_output(mb.softplus(x=pattern.m.outputs[0], name="sp", before_op=pattern.r))

    container = register_generic_pass(scaled, None, to_softplus_of_mul, "p", namespace)
    with pattern_infra.trace() as rewrites:
        container(prog)
    (rewrite,) = rewrites
    mul = rewrite.before[0]
    assert mul.type == "mul" and list(mul.consts.values()) == ["2"]
    assert [(op.name, op.type) for op in rewrite.after] == [("sp", "softplus"), ("m", "mul")]  # m stayed
    assert rewrite.removed == ["r"]


def test_nested_traces_both_receive_and_closing_stops_recording(namespace):
    container = register_generic_pass(relu_exp, None, to_softplus, "softplus", namespace)
    with pattern_infra.trace() as outer:
        with pattern_infra.trace() as inner:
            container(two_instances())
        assert tracing.recording
        container(two_instances())
    assert not tracing.recording
    assert (len(inner), len(outer)) == (2, 4)


def test_no_trace_open_means_no_recording(namespace, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("record() called while no trace is open")

    monkeypatch.setattr(tracing, "record", fail)
    container = register_generic_pass(relu_exp, None, to_softplus, "softplus", namespace)
    prog = two_instances()
    container(prog)
    assert container.stats.rewrites == 2
