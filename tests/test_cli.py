"""``mil-patterns``: optimize a saved model end to end, report, explain, list passes; exit codes.

A PyTorch pre-norm transformer is converted without the override and saved as an .mlpackage; the command
then optimises it. The result, loaded back, must compute what the saved model computes (reference
evaluator, tight tolerance) and what PyTorch computes, keep the model's metadata, and have the very op
counts of a conversion with the override on.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import forked
import numpy as np
import pytest
from cli_helpers import digest, invoke
from click.testing import CliRunner

from pattern_infra import evaluate
from pattern_infra.cli.commands import main
from pattern_infra.cli.mlpackage import load_mlpackage, op_histogram, pass_plan
from pattern_infra.verification.verify import assert_programs_equivalent

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
LAYER_NORMS = 5  # prenorm_transformer(n_layers=2): 2 per block and a final one (see the `saved` fixture)


def _check_optimized(saved, out: Path) -> None:
    original = load_mlpackage(saved["path"])
    optimized = load_mlpackage(out)
    counts = op_histogram(optimized.program)
    assert counts == saved["override_counts"]  # the very ops of a conversion with the override on
    assert counts["layer_norm"] == LAYER_NORMS and "reduce_mean" not in counts
    assert_programs_equivalent(original.program, optimized.program, rtol=1e-5, atol=1e-6)
    (name,) = list(optimized.program.functions["main"].inputs)
    (got,) = evaluate(optimized.program, {name: saved["args"][0].numpy()}).values()
    np.testing.assert_allclose(got, saved["torch"], rtol=1e-4, atol=1e-5)
    assert optimized.spec.description.metadata.author == "test author"
    assert optimized.spec.description.metadata.userDefined["origin"] == "tests/test_cli.py"
    assert optimized.spec.specificationVersion == original.spec.specificationVersion
    assert [i.name for i in optimized.spec.description.input] == [
        i.name for i in original.spec.description.input
    ]


def test_optimize_end_to_end(saved, tmp_path):
    before = digest(saved["path"])
    out = tmp_path / "optimized.mlpackage"
    result = invoke("optimize", saved["path"], "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert f"{LAYER_NORMS} rewrite(s); non-const ops 87 -> 47" in result.output
    _check_optimized(saved, out)
    assert digest(saved["path"]) == before  # the source is only read


def test_optimize_as_a_separate_process(saved, tmp_path):
    out = tmp_path / "optimized.mlpackage"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # A fresh interpreter forked from one that imported coremltools and torch (tests/forked.py).
    done = forked.run(
        ["-m", "pattern_infra", "optimize", str(saved["path"]), "-o", str(out), "--progress"],
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "passes" in done.stderr  # the progress bar, on stderr
    _check_optimized(saved, out)


def test_console_script_is_declared_and_points_at_the_command():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attribute = scripts["mil-patterns"].partition(":")
    import importlib

    assert getattr(importlib.import_module(module), attribute) is main


def test_exclude_keeps_a_pass_out(saved, tmp_path):
    out = tmp_path / "o.mlpackage"
    result = invoke(
        "optimize", saved["path"], "-o", out, "--exclude", "common::fuse_layernorm_or_instancenorm"
    )
    assert result.exit_code == 0, result.output
    counts = op_histogram(load_mlpackage(out).program)
    assert "layer_norm" not in counts
    # Without it, each layer norm's (x - u) / sqrt(mean((x - u)^2) + e) is an RMSNorm of x - u:
    # generic::fuse_rms_norm fuses those 5 (as it does in a conversion without the layer-norm pass).
    assert "5 rewrite(s); non-const ops 87 -> 77" in result.output
    assert counts["l2_norm"] == 5


def test_passes_selects_the_passes_run(saved, tmp_path):
    out = tmp_path / "o.mlpackage"
    result = invoke(
        "optimize",
        saved["path"],
        "-o",
        out,
        "--passes",
        "common::fuse_gelu_exact,common::fuse_layernorm_or_instancenorm",
    )
    assert result.exit_code == 0, result.output
    assert f"{LAYER_NORMS} rewrite(s)" in result.output


def test_report_lists_every_rewrite_and_writes_nothing(saved):
    before = digest(saved["path"])
    result = invoke("report", saved["path"], "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert [r["pass_id"] for r in data["rewrites"]] == [
        "common::fuse_layernorm_or_instancenorm"
    ] * LAYER_NORMS
    assert all(r["replaced_by"] and r["matched"] for r in data["rewrites"])
    assert data["after"]["layer_norm"] == LAYER_NORMS
    text = invoke("report", saved["path"])
    assert text.exit_code == 0
    assert f"common::fuse_layernorm_or_instancenorm: {LAYER_NORMS} rewrite(s)" in text.output
    assert text.output.count("(layer_norm)") == LAYER_NORMS
    assert digest(saved["path"]) == before


def test_explain_a_module_pattern_and_a_pass_id(saved, tmp_path, monkeypatch):
    (tmp_path / "my_patterns.py").write_text(
        "from coremltools.converters.mil import Builder as mb\n"
        "@mb.program(input_specs=[mb.TensorSpec(shape=(1, 16, 64))])\n"
        "def mean_sub(x):\n"
        "    m = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name='mean')\n"
        "    return mb.sub(x=x, y=m, name='centred')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = invoke("explain", saved["path"], "--pattern", "my_patterns:mean_sub")
    assert result.exit_code == 0, result.output
    assert f"{LAYER_NORMS} full match(es)" in result.output
    by_id = invoke("explain", saved["path"], "--pattern", "common::fuse_gelu_exact")
    assert by_id.exit_code == 0, by_id.output
    assert by_id.output.count("pattern 'gelu_exact[") == 6 and "0 full match(es)" in by_id.output


def test_passes_lists_ids_in_run_order():
    result = invoke("passes", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    ids = [row["id"] for row in rows]
    assert ids == list(dict.fromkeys(pass_plan()))
    assert ids.index("generic::fuse_reshape_linear_reshape") == ids.index("common::fuse_leaky_relu") + 1
    row = rows[ids.index("common::fuse_gelu_exact")]
    assert row["replaces"] == "fuse_gelu_exact" and row["run_after"] is None
    assert rows[ids.index("generic::fuse_sdpa")]["run_after"] == "common::fuse_layernorm_or_instancenorm"
    text = invoke("passes")
    assert "replaces coremltools' fuse_gelu_exact" in text.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["optimize", "missing.mlpackage", "-o", "x.mlpackage"], 2, "does not exist"),
        (
            ["optimize", "{model}", "-o", "{tmp}/o.mlpackage", "--passes", "common::fuse_gelu_exactt"],
            1,
            "Did you mean common::fuse_gelu_exact",
        ),
        (["optimize", "{model}", "-o", "{model}"], 1, "refusing to write over the model being read"),
        (["optimize", "{model}", "-o", "{tmp}"], 2, "whose name ends in .mlpackage"),
        (["optimize", "{model}", "-o", "{tmp}/old.mlpackage"], 1, "exists; remove it or ask to overwrite it"),
        (["optimize", "{model}"], 2, "Missing option '-o'"),
        (["report", "{tmp}/not_a_model.txt"], 1, "cannot read it as a Core ML model"),
        (["explain", "{model}", "--pattern", "nocolon"], 2, "expected MODULE:NAME or a pass id"),
        (
            ["explain", "{model}", "--pattern", "common::fuse_gelu_exakt"],
            1,
            "did you mean common::fuse_gelu_exact",
        ),
        (["explain", "{model}", "--pattern", "os:no_such_name"], 1, "module 'os' has no 'no_such_name'"),
        (["--import", "no_such_module_anywhere", "passes"], 2, "importable from the current directory"),
        (["frobnicate"], 2, "No such command"),
    ],
)
def test_exit_codes_and_messages(saved, tmp_path, args, code, message):
    (tmp_path / "not_a_model.txt").write_text("hello")
    (tmp_path / "old.mlpackage").mkdir()
    (tmp_path / "old.mlpackage" / "Manifest.json").write_text("{}")
    args = [a.format(model=saved["path"], tmp=tmp_path) for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert type(result.exception) is SystemExit  # exited through click, not an uncaught exception


def test_import_finds_a_module_in_the_current_directory(tmp_path, monkeypatch):
    """As ``python -m pattern_infra --import my_passes`` does; the installed script did not."""
    (tmp_path / "my_cwd_passes.py").write_text(
        "from coremltools.converters.mil import Builder as mb\n"
        "from pattern_infra import register_generic_pass\n"
        "@mb.program(input_specs=[mb.TensorSpec(shape=(4,))])\n"
        "def relu_relu(x):\n"
        "    return mb.relu(x=mb.relu(x=x, name='a'), name='b')\n"
        "register_generic_pass(relu_relu, None, lambda p: False, 'from_cwd', 'mine')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        result = invoke("--import", "my_cwd_passes", "passes")
        assert result.exit_code == 0, result.output
        assert "mine::from_cwd" in result.output
    finally:
        sys.modules.pop("my_cwd_passes", None)
        from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

        PASS_REGISTRY.passes.pop("mine::from_cwd", None)


def test_help_lists_the_exit_statuses():
    from pattern_infra.cli.commands import EXIT_CODES

    for args in (["--help"], ["optimize", "--help"], ["report", "--help"], ["explain", "--help"]):
        text = invoke(*args).output
        assert "Exit status:" in text
        for code in EXIT_CODES:
            assert f"  {code}  " in text
    docs = (ROOT / "docs" / "CLI.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in docs
