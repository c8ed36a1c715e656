"""The pipeline stage: ``register_generic_pass`` and pass ids (:mod:`.registry`), the coremltools graph
pass and the override (:mod:`.container`), ``pipeline()`` and its sweeps (:mod:`.sweep`).
``pattern_infra.pipeline`` is the function; import these modules with
``from pattern_infra.pipeline.<module> import ...``."""

from .container import ENV_VAR, PassContainer, override, override_enabled, run_log
from .registry import generic_passes, register_generic_pass, register_graph_pass
from .sweep import GenericSweep, pipeline

__all__ = [
    "ENV_VAR",
    "GenericSweep",
    "PassContainer",
    "generic_passes",
    "override",
    "override_enabled",
    "pipeline",
    "register_generic_pass",
    "register_graph_pass",
    "run_log",
]
