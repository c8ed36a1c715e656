"""Run a Python script or ``-c`` code as a fresh interpreter would, without paying its start-up each time.

The example scripts and the documentation snippets each run in their own interpreter, so that one
script's conversion, registered passes or environment cannot leak into the next. Importing coremltools
and torch is most of such an interpreter's time. Here one *zygote* interpreter per pytest process
imports them once (and nothing of the project) and waits; every run forks it, and the child, a copy of
that untouched interpreter, runs the script with ``runpy`` as ``python script.py``, ``python -c code``
or ``python -m module`` would: its own ``sys.argv``, ``sys.path[0]``, working directory, environment
and standard input, its standard output and error (the file descriptors, so C-level output too)
captured, its exit status returned. One script per child process: each keeps its isolation, the zygote
stays clean.

Use :func:`run` like ``subprocess.run(..., capture_output=True, text=True)``.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

_ZYGOTE = r"""
import json, os, runpy, signal, sys, time, traceback

import coremltools  # noqa: F401  the expensive imports, done once
import torch  # noqa: F401

protocol_in, protocol_out = sys.stdin, sys.stdout


def child(job):
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_TRUNC
        target = os.open(job[name], flags)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = list(job["argv"])
    # PYTHONPATH entries a fresh interpreter would put on sys.path (after sys.path[0]).
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    code = 0
    try:
        if job["argv"][0] == "-c":
            sys.argv = ["-c", *job["argv"][2:]]
            sys.path[0] = ""
            namespace = {"__name__": "__main__", "__builtins__": __builtins__}
            exec(compile(job["argv"][1], "<string>", "exec"), namespace)
        elif job["argv"][0] == "-m":
            sys.argv = [job["argv"][1], *job["argv"][2:]]  # run_module puts the module's path in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(job["argv"][1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(job["argv"][0]))
            runpy.run_path(job["argv"][0], run_name="__main__")
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException as failure:
        # The traceback from the script's own frames down, as the interpreter would print it.
        traceback.print_exception(failure, failure, failure.__traceback__.tb_next)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


for line in protocol_in:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        protocol_in.close()
        child(job)
    deadline = time.monotonic() + job["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            returncode = None
            break
        time.sleep(0.02)
    protocol_out.write(json.dumps({"returncode": returncode}) + "\n")
    protocol_out.flush()
"""

_zygote: subprocess.Popen[str] | None = None


def _start() -> subprocess.Popen[str]:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        atexit.register(_stop, _zygote)
    return _zygote


def _stop(zygote: subprocess.Popen[str]) -> None:
    if zygote.poll() is None:
        zygote.stdin.close()
        try:
            zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()


def run(
    argv: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``python *argv`` (a script, ``-c`` code or ``-m`` module, with arguments) in a fresh interpreter.

    Args:
        argv: What follows ``python`` on the command line: ``[script, *args]``, ``["-c", code, *args]`` or
            ``["-m", module, *args]``.
        cwd: The working directory of the run (the caller's by default).
        env: Its whole environment (the caller's ``os.environ`` by default).
        input: Text on its standard input (empty by default).
        timeout: Seconds before the run is killed.

    Returns:
        The exit status and the captured standard output and error, as text.

    Raises:
        subprocess.TimeoutExpired: The run took longer than ``timeout``; it was killed.
        RuntimeError: The zygote interpreter died (its imports failed, or it was killed).
    """
    zygote = _start()
    with tempfile.TemporaryDirectory(prefix="forked-") as scratch:
        files = {name: os.path.join(scratch, name) for name in ("stdin", "stdout", "stderr")}
        for name, path in files.items():
            Path(path).write_text((input or "") if name == "stdin" else "")
        job = {
            "argv": list(argv),
            "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
            "env": dict(os.environ if env is None else env),
            "timeout": timeout,
            **files,
        }
        try:
            zygote.stdin.write(json.dumps(job) + "\n")
            zygote.stdin.flush()
            answer = zygote.stdout.readline()
        except BrokenPipeError:
            answer = ""
        if not answer:
            raise RuntimeError("the zygote interpreter of tests/forked.py died; run the script directly")
        returncode = json.loads(answer)["returncode"]
        stdout = Path(files["stdout"]).read_text(errors="replace")
        stderr = Path(files["stderr"]).read_text(errors="replace")
    if returncode is None:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess([sys.executable, *argv], returncode, stdout, stderr)
