"""The passes: ``register_generic_pass`` and the pass ids (:mod:`.registry`), the coremltools graph pass
a registration makes and the override (:mod:`.container`), and the pipeline, ``pipeline()`` with its
sweeps (:mod:`.sweep`). Imports the three stages before it. (Named ``passes``, not ``pipeline``: the
package's ``pattern_infra.pipeline`` is the public function.)"""

from .container import ENV_VAR, PassContainer, override, override_enabled, run_log
from .registry import generic_passes, register_generic_pass, register_graph_pass
from .sweep import GenericSweep, pipeline

__all__ = ["ENV_VAR", "GenericSweep", "PassContainer", "generic_passes", "override", "override_enabled", "pipeline",
           "register_generic_pass", "register_graph_pass", "run_log"]
