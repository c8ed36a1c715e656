"""The ``mil-patterns`` command line (:mod:`.commands`), the saved models it reads and writes
(:mod:`.mlpackage`) and coremltools' start-up noise held back (:mod:`.quiet`). Importing this package
imports nothing: the package's ``__init__`` needs :mod:`.quiet` before coremltools loads."""
