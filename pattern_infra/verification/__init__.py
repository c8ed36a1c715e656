"""Verification tooling, outside the runtime import path: ``import pattern_infra`` loads only its errors
(:mod:`.errors`).

* :mod:`.evaluator`: a numpy reference evaluator of MIL programs (the numerics Core ML's runtime would
  give, where the runtime exists only on macOS), with the op table of what it evaluates;
* :mod:`.verify`: numeric equivalence of two programs on random inputs (:mod:`.inputs`), pass checks
  (``verify_pass``);
* :mod:`.symbolic` with :mod:`.sympy_ops`: symbolic proofs with sympy (``prove_equivalent``).

The names are reached as ``pattern_infra.evaluate``, ``pattern_infra.verify_pass`` and so on, which
import this subpackage on first use (``pattern_infra.__getattr__``), or as
``pattern_infra.verification.verify`` directly.
"""
