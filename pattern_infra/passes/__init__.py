"""The passes stage: ``register_generic_pass`` and pass ids (:mod:`.registry`), the coremltools graph
pass and the override (:mod:`.container`), ``pipeline()`` and its sweeps (:mod:`.sweep`). No public
name shadows this package: ``import pattern_infra.passes.container as c`` works."""

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
