"""`make demo`: a PyTorch pre-norm transformer converted twice, with and without our passes.

The model is written the way popular model libraries write it: GELU as the tanh formula, LayerNorm
written out as ``w * (x - u) / torch.sqrt(var + eps) + b``, in pre-norm residual blocks (so each layer
norm's input also feeds the residual add). It is converted with ``coremltools.convert`` once as is and
once with ``ENABLE_EXPERIMENTAL_PASSES=1``, both timed after an untimed warm-up conversion (so the two
times compare like with like); the script prints the op counts, which generic passes fired, and checks
that both programs compute what PyTorch computes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections import Counter

os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' per-pass progress bars
logging.getLogger("coremltools").setLevel(logging.ERROR)
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pattern_infra import run_log  # noqa: E402
from pattern_infra.testing.convert import convert_torch, op_counts  # noqa: E402
from pattern_infra.testing.models import prenorm_transformer  # noqa: E402

N_LAYERS = 2


def _evaluate(prog, inputs):
    """Runs a program with the project's reference evaluator, if it is installed with the project."""
    from pattern_infra.verification.evaluator import evaluate

    return evaluate(prog, inputs)


def main() -> int:
    model, args = prenorm_transformer(n_layers=N_LAYERS)
    print(f"PyTorch pre-norm transformer, {N_LAYERS} layers: tanh-formula GELU, written-out LayerNorm")
    print("  LayerNorm: w * (x - u) / torch.sqrt(var + eps) + b   (input also feeds the residual add)\n")

    # Warm-up, not timed: the first conversion in a process also pays for imports, torch.export's caches
    # and the generation of our passes' search code; timing it against a later one would compare a cold
    # conversion with a warm one. After this, each conversion below is warm.
    convert_torch(model, args, override=True)
    programs, seconds, fired = {}, {}, {}
    for override in (False, True):
        run_log(clear=True)
        start = time.perf_counter()
        programs[override] = convert_torch(model, args, override=override)
        seconds[override] = time.perf_counter() - start
        fired[override] = Counter()
        for pass_id, _, stats in run_log(clear=True):
            fired[override][pass_id] += stats.rewrites

    plain, ours = (op_counts(programs[k]) for k in (False, True))
    plain.pop("const", None)
    ours.pop("const", None)
    print(f"{'op type':<22}{'coremltools':>12}{'+ generic passes':>18}")
    for op_type in sorted(set(plain) | set(ours)):
        marker = "  <-" if plain[op_type] != ours[op_type] else ""
        print(f"{op_type:<22}{plain[op_type]:>12}{ours[op_type]:>18}{marker}")
    print(f"{'total (no consts)':<22}{sum(plain.values()):>12}{sum(ours.values()):>18}")
    print(f"{'convert time (s, warm)':<22}{seconds[False]:>12.2f}{seconds[True]:>18.2f}\n")

    print("generic passes that changed the program (ENABLE_EXPERIMENTAL_PASSES=1):")
    for pass_id, rewrites in sorted(fired[True].items()):
        if rewrites:
            print(f"  {pass_id:<45} {rewrites} rewrite(s)")

    n_norms = 2 * N_LAYERS + 1
    per_norm = (sum(plain.values()) - sum(ours.values())) // n_norms + 1
    print(
        f"\neach written-out LayerNorm: {per_norm} ops with coremltools alone -> 1 layer_norm with the "
        f"override ({ours['layer_norm']} of {n_norms} norms fused)"
    )

    x = args[0]
    with torch.no_grad():
        expected = model(x).numpy()
    feed = {name: x.numpy() for name in programs[True].functions["main"].inputs}
    worst = 0.0
    for override, prog in programs.items():
        (got,) = _evaluate(prog, feed).values()
        err = float(np.max(np.abs(got - expected)))
        worst = max(worst, err)
        label = "with generic passes" if override else "coremltools only"
        print(f"max |MIL - PyTorch| ({label}): {err:.2e}")
    ok = ours["layer_norm"] == 2 * N_LAYERS + 1 and ours["gelu"] == N_LAYERS and worst < 1e-3
    print("\nOK: both fusions fired and the outputs agree" if ok else "\nUNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
