"""``python -m bench.instructions``: instructions executed per fused instance, ours against the floor.

Wall time on a shared machine moves by +-10% from run to run, more than most single changes to the
driver or the journal gain or lose. The number of machine instructions does not move: this tool runs
one workload under valgrind's ``callgrind`` and counts only the instructions executed inside the timed
calls of runner (c) ours and runner (d) the rewrite floor (see :mod:`bench.runners`), the same calls
``make bench`` times. Two runs of the same tree give the same count to the instruction
(``PYTHONHASHSEED=0``), so a change can be compared before and after in one run each.

Instructions are not time: per instruction, ours also misses the caches more often than the floor (it
touches ops the floor never sees: the walk that indexes the block, the search). Use it to compare two
versions of the code, and ``make bench`` for the ratios of time.

Usage::

    python -m bench.instructions gelu 100          # ours and the floor, per fused instance, and c/d
    python -m bench.instructions layernorm 50 --runner c

Needs ``valgrind`` on the PATH (not a project dependency); each runner takes one to three minutes.
"""

from __future__ import annotations

import argparse
import copy
import gc
import operator
import os
import re
import shutil
import subprocess
import sys

__all__ = ["count", "count_instructions", "main"]

_TOGGLE = "_operator_call"
"""The C function callgrind counts inside: ``operator.call``, which nothing else here calls."""
_REPEATS = 4
"""Counted runs per runner, each on a fresh copy, after one uncounted run (code generation, caches)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n")[0])
    from bench.suites import CHAINS

    parser.add_argument("workload", choices=sorted(CHAINS))
    parser.add_argument("n", type=int, help="instances in the chain")
    parser.add_argument(
        "--runner", choices=("c", "d"), action="append", help="c (ours) or d (floor); both when omitted"
    )
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _counted_runs(workload: str, n: int, runner_key: str) -> None:
    """What runs under valgrind: one uncounted run, then ``_REPEATS`` counted ones."""
    from bench.runners import _restore_name_counter, name_counter_state, workload_runners
    from bench.suites import CHAINS

    prog = CHAINS[workload][0](n)
    runner = workload_runners(workload).runners[runner_key]
    names = name_counter_state()
    for i in range(_REPEATS + 1):
        work = copy.deepcopy(prog)
        _restore_name_counter(names)
        call = runner.prepare(work)
        gc.collect()
        if i == 0:
            call()
        else:
            operator.call(call)  # the only instructions counted
        del work, call


def count(workload: str, n: int, runner_key: str) -> int:
    """Instructions per instance of ``workload`` (a chain of ``n``) for runner ``c`` or ``d``.

    Raises:
        RuntimeError: valgrind is missing, or the run failed (its output is in the message).
    """
    arguments = ["-m", "bench.instructions", workload, str(n), "--runner", runner_key, "--inner"]
    return count_instructions(arguments) // (_REPEATS * n)


def count_instructions(arguments: list[str]) -> int:
    """Instructions executed inside ``operator.call`` by ``python <arguments>`` under callgrind, in all.

    Raises:
        RuntimeError: valgrind is missing, or the run failed (its output is in the message).
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError(
            "valgrind is not on the PATH; install it (e.g. apt-get install valgrind) to count instructions"
        )
    env = dict(os.environ, PYTHONHASHSEED="0", TQDM_DISABLE="1")
    command = [
        valgrind,
        "--tool=callgrind",
        f"--toggle-collect={_TOGGLE}",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        *arguments,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    runners = args.runner or ["c", "d"]
    if args.inner:
        from bench.workloads import run_with_deep_stack

        run_with_deep_stack(lambda: _counted_runs(args.workload, args.n, runners[0]))
        return 0
    counts = {}
    for key in runners:
        try:
            counts[key] = count(args.workload, args.n, key)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        label = "ours" if key == "c" else "floor"
        print(f"{args.workload} N={args.n} {label} ({key}): {counts[key]:,} instructions per instance")
    if len(counts) == 2:
        print(f"c/d: {counts['c'] / counts['d']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
