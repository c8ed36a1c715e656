"""The passes: ``register_generic_pass`` and the pass ids (:mod:`.registry`), the coremltools graph pass
a registration makes and the override (:mod:`.container`), and the pipeline, ``pipeline()`` with its
sweeps (:mod:`.sweep`). Imports the three stages before it.

``pattern_infra.pipeline`` is the public function :func:`~.sweep.pipeline`, bound by the package's
``__init__`` over this package's name: import the modules with ``from pattern_infra.pipeline.container
import PassContainer`` (``import pattern_infra.pipeline.container as c`` looks the module up on the function)."""

from .container import ENV_VAR, PassContainer, override, override_enabled, run_log
from .registry import generic_passes, register_generic_pass, register_graph_pass
from .sweep import GenericSweep, pipeline

__all__ = ["ENV_VAR", "GenericSweep", "PassContainer", "generic_passes", "override", "override_enabled", "pipeline",
           "register_generic_pass", "register_graph_pass", "run_log"]
