"""Benchmark of the generic passes against coremltools, side by side in one process (``make bench``).

``python -m bench`` prints the table and the targets, writes ``bench/out/results.json`` and
``bench/out/scaling.png``; ``--quick`` measures small N only; ``--profile N`` profiles our GELU pass.
"""

__all__: list[str] = []
