"""``mil-patterns``: ``optimize --verify`` refuses a pass that changes what the model computes, pass ids
are suggested by name, and a plain command prints no import-time warning (``--debug`` does)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import digest, invoke

from pattern_infra.cli.commands import DEFAULT_TOLERANCE, nearest_pass_ids
from pattern_infra.passes.registry import generic_passes

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

WRONG_PASS = '''
"""softmax(x) rewritten as softmax(1.05 * x): plausible, and wrong."""
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol
from pattern_infra import register_generic_pass


@mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(), get_new_symbol(), get_new_symbol()))])
def softmax(x):
    return mb.softmax(x=x, axis=-1, name="softmax")


def not_rewritten_yet(pattern):
    producer = pattern.root_var.op
    return producer is None or not producer.name.startswith("scaled_")


def scale_the_logits(pattern):
    op = pattern.softmax
    scaled = mb.mul(x=pattern.root_var, y=np.float32(1.05), name="scaled_" + op.name, before_op=op)
    out = mb.softmax(x=scaled, axis=op.axis.val, name=op.outputs[0].name, before_op=op)
    pattern.replace_output(out)


register_generic_pass(softmax, not_rewritten_yet, scale_the_logits, "scale_softmax", "{namespace}")
'''


def test_a_correct_pass_passes_and_the_difference_is_printed(saved, tmp_path):
    out = tmp_path / "fused.mlpackage"
    result = invoke("optimize", saved["path"], "-o", out, "--no-progress", "--verify")
    assert result.exit_code == 0, result.output
    assert f"over 2 random input sets, tolerance {DEFAULT_TOLERANCE:g}" in result.output
    assert "5 rewrite(s)" in result.output and (out / "Manifest.json").is_file()


@pytest.fixture
def wrong_pass(tmp_path, monkeypatch, namespace):
    """A module registering a wrong pass under ``namespace``, importable from the current directory."""
    module = f"wrong_pass_{namespace}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(WRONG_PASS).replace("{namespace}", namespace))
    monkeypatch.chdir(tmp_path)
    yield module, f"{namespace}::scale_softmax"
    sys.modules.pop(module, None)


@pytest.mark.parametrize("existing", ["package", "nothing"])
def test_a_wrong_pass_is_refused_and_the_output_left_as_it_was(saved, tmp_path, wrong_pass, existing):
    module, pass_id = wrong_pass
    out = tmp_path / "fused.mlpackage"
    if existing == "package":
        assert invoke("optimize", saved["path"], "-o", out, "--no-progress").exit_code == 0
        before = digest(out)
    args = ["--import", module, "optimize", saved["path"], "-o", out, "--overwrite", "--no-progress"]
    result = invoke(*args, "--passes", pass_id, "--verify")
    assert result.exit_code == 1, result.output
    assert "exceeds --tolerance" in result.output and "was not written" in result.output
    assert "Traceback" not in result.output
    if existing == "package":
        assert digest(out) == before
    else:
        assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".fused")] == []
    # the same pass is written without --verify, and with a tolerance above its difference
    assert invoke(*args, "--passes", pass_id, "--verify", "--tolerance", "0.1").exit_code == 0
    assert (out / "Manifest.json").is_file()


def test_the_tolerance_must_be_a_non_negative_number(saved, tmp_path):
    result = invoke(
        "optimize", saved["path"], "-o", tmp_path / "o.mlpackage", "--verify", "--tolerance", "-1"
    )
    assert result.exit_code == 2 and "--tolerance" in result.output


def test_flexible_dimensions_are_sized_within_their_ranges():
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.milproto import load as milproto
    from coremltools.converters.mil.mil import get_new_symbol

    from pattern_infra.verification.inputs import random_inputs, sizes_in_ranges

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(get_new_symbol(), 4)), mb.TensorSpec(shape=(1, get_new_symbol()))]
    )
    def prog(x, y):
        return mb.relu(x=x), mb.relu(x=y)

    mlmodel = ct.convert(
        prog,
        convert_to="mlprogram",
        inputs=[
            ct.TensorType(name="x", shape=(ct.RangeDim(7, 9), 4)),
            ct.TensorType(name="y", shape=ct.EnumeratedShapes(shapes=[(1, 11), (1, 13)])),
        ],
        skip_model_load=True,
    )
    spec = mlmodel.get_spec()
    loaded = milproto.load(spec, spec.specificationVersion, mlmodel.weights_dir)
    sizes = sizes_in_ranges(loaded, spec.description)
    shapes = {name: value.shape for name, value in random_inputs(loaded, sizes_for_symbols=sizes).items()}
    assert shapes == {"x": (7, 4), "y": (1, 11)}


# ---- pass ids suggested by name ------------------------------------------------------------------


def test_a_misspelt_id_suggests_the_pass_meant_not_its_namespace_neighbours(saved, tmp_path):
    ids = list(generic_passes())
    assert nearest_pass_ids("common::fuse_layernom", ids) == ["common::fuse_layernorm_or_instancenorm"]
    assert nearest_pass_ids("fuse_layernorm", ids) == ["common::fuse_layernorm_or_instancenorm"]
    assert nearest_pass_ids("frobnicate_everything", ids) == []
    result = invoke(
        "optimize", saved["path"], "-o", tmp_path / "o.mlpackage", "--passes", "common::fuse_layernom"
    )
    assert result.exit_code == 1
    assert "Did you mean common::fuse_layernorm_or_instancenorm?" in result.output
    assert "fuse_leaky_relu" not in result.output and "fuse_pad_conv" not in result.output
    assert not (tmp_path / "o.mlpackage").exists()


def test_a_pattern_without_namespace_suggests_the_pass_id(saved):
    result = invoke("explain", saved["path"], "--pattern", "fuse_layernorm")
    assert result.exit_code == 2
    assert "did you mean common::fuse_layernorm_or_instancenorm?" in " ".join(result.output.split())


# ---- a quiet command line --------------------------------------------------------------------------


def _stderr(*args: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


@pytest.fixture(scope="module")
def import_warnings() -> list[str]:
    """What a bare ``import coremltools`` prints to stderr here (read once for the module's tests)."""
    return _stderr("-c", "import coremltools")


def test_a_plain_command_prints_no_warning_and_debug_shows_them(import_warnings):
    assert import_warnings, "coremltools printed nothing on import here: nothing to silence"
    assert _stderr("-m", "pattern_infra", "passes") == []
    shown = _stderr("-m", "pattern_infra", "--debug", "passes")
    assert [line for line in import_warnings if line not in shown] == []


def test_a_library_import_still_shows_them(import_warnings):
    assert _stderr("-c", "import pattern_infra") == import_warnings
