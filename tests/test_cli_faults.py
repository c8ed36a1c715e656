"""Fault injection into ``mil-patterns``: damaged and ill-formed inputs and outputs.

Each case damages a copy of a saved model, or asks for an output that cannot or must not be written,
runs the command, and checks: the exit status; a message of one line naming the file (or the option) and
what is wrong; no traceback (the command exits through click, never through an uncaught exception);
no partial output and no file lost (every file under the work folder is byte for byte as before, and
nothing was added).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from pattern_infra.cli.commands import main

WEIGHTS = Path("Data/com.apple.CoreML/weights/weight.bin")
SPEC = Path("Data/com.apple.CoreML/model.mlmodel")


def _tree(root: Path) -> dict[str, str]:
    """Every file and folder under ``root``, with a digest of each file's bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = path.relative_to(root).as_posix()
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return found


@pytest.fixture
def work(saved, tmp_path):
    """A folder holding a copy of the saved transformer, ``in.mlpackage``."""
    shutil.copytree(saved["path"], tmp_path / "in.mlpackage")
    return tmp_path


# -- damaged inputs: (how to damage the copy, the input to give, what the message names) -----------------


def _truncate_weights(work: Path) -> Path:
    with open(work / "in.mlpackage" / WEIGHTS, "r+b") as f:
        f.truncate(1000)
    return work / "in.mlpackage"


def _garble_weight_header(work: Path) -> Path:
    with open(work / "in.mlpackage" / WEIGHTS, "r+b") as f:
        f.write(b"\xff" * 64)
    return work / "in.mlpackage"


def _delete_weights(work: Path) -> Path:
    (work / "in.mlpackage" / WEIGHTS).unlink()
    return work / "in.mlpackage"


def _empty_spec(work: Path) -> Path:
    (work / "in.mlpackage" / SPEC).write_bytes(b"")
    return work / "in.mlpackage"


def _garble_spec(work: Path) -> Path:
    (work / "in.mlpackage" / SPEC).write_bytes(b"\x08\x04garbage" * 50)
    return work / "in.mlpackage"


def _plain_folder(work: Path) -> Path:
    folder = work / "folder.mlpackage"
    folder.mkdir()
    (folder / "notes.txt").write_text("not a model")
    return folder


def _text_file(work: Path) -> Path:
    path = work / "notes.txt"
    path.write_text("hello")
    return path


def _neural_network(work: Path) -> Path:
    import coremltools as ct

    spec = ct.proto.Model_pb2.Model()
    spec.specificationVersion = 4
    spec.neuralNetwork.SetInParent()
    path = work / "nn.mlmodel"
    path.write_bytes(spec.SerializeToString())
    return path


DAMAGED = {
    "truncated weights": (_truncate_weights, [f"{WEIGHTS}", "truncated or damaged"]),
    "garbled weight header": (_garble_weight_header, [f"{WEIGHTS}", "truncated or damaged"]),
    "missing weights": (_delete_weights, [f"{WEIGHTS}", "missing"]),
    "empty spec": (_empty_spec, [f"{SPEC}", "empty model specification"]),
    "garbled spec": (_garble_spec, ["in.mlpackage", "cannot read it as a Core ML model"]),
    "folder, not a package": (_plain_folder, ["folder.mlpackage", "not a model package"]),
    "text file": (_text_file, ["notes.txt", "cannot read it as a Core ML model"]),
    "neural network": (_neural_network, ["nn.mlmodel", "a neuralNetwork model, not an ML program"]),
}


def _command(name: str, source: Path, work: Path) -> list[str]:
    if name == "optimize":
        return ["optimize", str(source), "-o", str(work / "out.mlpackage")]
    if name == "report":
        return ["report", str(source), "--json"]
    return ["explain", str(source), "--pattern", "common::fuse_gelu_exact"]


def _check_clean_failure(result, code: int, names: list[str]) -> str:
    """The exit status, one line naming ``names`` (its ``Error:`` line for a usage error), no traceback."""
    assert result.exit_code == code, result.output
    assert type(result.exception) is SystemExit, result.exc_info  # exited through click: no traceback
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    if code == 1:
        assert len(lines) == 1, result.output
    (message,) = [line for line in lines if line.startswith("Error:")]
    for name in names:
        assert name in message, message
    return message


@pytest.mark.parametrize("command", ["optimize", "report", "explain"])
@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_input_is_one_line_naming_the_file(work, case, command):
    damage, names = DAMAGED[case]
    source = damage(work)
    before = _tree(work)
    result = CliRunner().invoke(main, _command(command, source, work))
    _check_clean_failure(result, 1, names)
    assert _tree(work) == before  # nothing written, nothing lost


# -- outputs that cannot or must not be written ----------------------------------------------------------


def _existing_file_overwritten(work: Path) -> tuple[list[str], int, list[str]]:
    (work / "notes.txt").write_text("my notes")
    return ["-o", str(work / "notes.txt"), "--overwrite"], 2, ["notes.txt", "notes.mlpackage"]


def _plain_name(work: Path) -> tuple[list[str], int, list[str]]:
    return ["-o", str(work / "plainname")], 2, ["plainname", "plainname.mlpackage"]


def _non_model_overwritten(work: Path) -> tuple[list[str], int, list[str]]:
    (work / "notes.mlpackage").write_text("a file with a package's name")
    return ["-o", str(work / "notes.mlpackage"), "--overwrite"], 1, ["notes.mlpackage", "not a model package"]


def _non_model_folder_overwritten(work: Path) -> tuple[list[str], int, list[str]]:
    (work / "photos.mlpackage").mkdir()
    (work / "photos.mlpackage" / "cat.jpg").write_bytes(b"\xff\xd8")
    return (
        ["-o", str(work / "photos.mlpackage"), "--overwrite"],
        1,
        ["photos.mlpackage", "not a model package"],
    )


def _existing_without_overwrite(work: Path) -> tuple[list[str], int, list[str]]:
    shutil.copytree(work / "in.mlpackage", work / "old.mlpackage")
    return ["-o", str(work / "old.mlpackage")], 1, ["old.mlpackage", "--overwrite"]


def _inside_the_input(work: Path) -> tuple[list[str], int, list[str]]:
    return (
        ["-o", str(work / "in.mlpackage" / "out.mlpackage")],
        1,
        ["out.mlpackage", "inside the model being read"],
    )


def _the_input_itself(work: Path) -> tuple[list[str], int, list[str]]:
    return ["-o", str(work / "in.mlpackage"), "--overwrite"], 1, ["in.mlpackage", "refusing to write over"]


def _missing_folder(work: Path) -> tuple[list[str], int, list[str]]:
    return ["-o", str(work / "nowhere" / "out.mlpackage")], 1, ["nowhere", "does not exist"]


def _read_only_folder(work: Path) -> tuple[list[str], int, list[str]]:
    if os.geteuid() == 0:  # root writes into a folder without write permission: use one even root cannot
        folder = Path("/sys")
    else:
        folder = work / "locked"
        folder.mkdir()
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return ["-o", str(folder / "out.mlpackage")], 1, [str(folder), "cannot write in the folder"]


def _failing_pass_over_an_old_output(work: Path) -> tuple[list[str], int, list[str]]:
    """A pass of the user's raises: the existing output (overwrite asked) must stay whole."""
    shutil.copytree(work / "in.mlpackage", work / "old.mlpackage")
    (work / "raising_pass_module.py").write_text(
        "from coremltools.converters.mil import Builder as mb\n"
        "from coremltools.converters.mil.mil import get_new_symbol\n"
        "from pattern_infra import register_generic_pass\n"
        "@mb.program(input_specs=[mb.TensorSpec(shape=(1, get_new_symbol(), 64))])\n"
        "def centred(x):\n"
        "    m = mb.reduce_mean(x=x, axes=[-1], keep_dims=True, name='mean')\n"
        "    return mb.sub(x=x, y=m, name='sub')\n"
        "def transform(pattern):\n"
        "    raise RuntimeError('a bug in my transform')\n"
        "register_generic_pass(centred, None, transform, 'fails', 'faults')\n"
    )
    return (
        ["-o", str(work / "old.mlpackage"), "--overwrite", "--passes", "faults::fails"],
        1,
        ["faults::fails", "a bug in my transform"],
    )


OUTPUTS: dict[str, Callable[[Path], tuple[list[str], int, list[str]]]] = {
    "an existing non-package file with --overwrite": _existing_file_overwritten,
    "a plain name": _plain_name,
    "--overwrite onto a file": _non_model_overwritten,
    "--overwrite onto a folder": _non_model_folder_overwritten,
    "an existing output": _existing_without_overwrite,
    "inside the input": _inside_the_input,
    "the input itself": _the_input_itself,
    "a missing folder": _missing_folder,
    "a read-only folder": _read_only_folder,
    "a failing pass over an old output": _failing_pass_over_an_old_output,
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_an_output_that_cannot_be_written_is_refused_and_nothing_is_lost(work, case, monkeypatch):
    monkeypatch.chdir(work)
    args, code, names = OUTPUTS[case](work)
    before = _tree(work)
    imports = ["--import", "raising_pass_module"] if "faults::fails" in args else []
    result = CliRunner().invoke(
        main, [*imports, "optimize", str(work / "in.mlpackage"), *args, "--no-progress"]
    )
    _check_clean_failure(result, code, names)
    after = _tree(work)
    after.pop("__pycache__", None)
    after = {k: v for k, v in after.items() if not k.startswith("__pycache__/")}
    assert after == before  # no partial output, no temporary folder left, no file lost


def test_overwrite_replaces_a_model_package_and_prints_the_path_written(work, monkeypatch):
    shutil.copytree(work / "in.mlpackage", work / "old.mlpackage")
    (work / "old.mlpackage" / "stale.txt").write_text("from the old package")
    result = CliRunner().invoke(
        main,
        [
            "optimize",
            str(work / "in.mlpackage"),
            "-o",
            str(work / "old.mlpackage"),
            "--overwrite",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"{work / 'old.mlpackage'}: 5 rewrite(s)"), (
        result.output
    )  # no progress bar
    assert not (work / "old.mlpackage" / "stale.txt").exists()
    assert sorted(p.name for p in work.iterdir()) == ["in.mlpackage", "old.mlpackage"]  # no temporary left


def test_debug_shows_the_traceback(work):
    _truncate_weights(work)
    result = CliRunner().invoke(main, ["--debug", "report", str(work / "in.mlpackage")])
    assert result.exit_code == 1
    assert type(result.exception) is not SystemExit  # propagated: Python prints its traceback
    assert "truncated or damaged" in str(result.exception)


def test_optimize_refuses_a_model_of_several_functions_before_any_work(tmp_path):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    def save(name, body):
        @mb.program(input_specs=[mb.TensorSpec(shape=(1, 8))], opset_version=ct.target.iOS18)
        def prog(x):
            return body(x)

        ct.convert(
            prog, convert_to="mlprogram", skip_model_load=True, minimum_deployment_target=ct.target.iOS18
        ).save(str(tmp_path / f"{name}.mlpackage"))

    save("a", lambda x: mb.relu(x=x))
    save("b", lambda x: mb.exp(x=x))
    functions = ct.utils.MultiFunctionDescriptor()
    functions.add_function(str(tmp_path / "a.mlpackage"), "main", "f_a")
    functions.add_function(str(tmp_path / "b.mlpackage"), "main", "f_b")
    functions.default_function_name = "f_a"
    ct.utils.save_multifunction(functions, str(tmp_path / "multi.mlpackage"))
    before = _tree(tmp_path)
    result = CliRunner().invoke(
        main, ["optimize", str(tmp_path / "multi.mlpackage"), "-o", str(tmp_path / "o.mlpackage")]
    )
    _check_clean_failure(result, 1, ["multi.mlpackage", "2 functions (f_a, f_b)"])
    assert _tree(tmp_path) == before
    assert (
        CliRunner().invoke(main, ["report", str(tmp_path / "multi.mlpackage")]).exit_code == 0
    )  # read: fine
