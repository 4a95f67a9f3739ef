"""Pipelines: a source and its stages.

``stages``       stateless stages (generator functions) and the stages with a position
``stateful``     stages that hold a position, with explicit saveable state
``fusion``       the stage record and the one rewrite of a stage list
``collation``    collations (padded, packed) and the array-type registry
``composition``  ``DataPipeline``: a source and stages, the fluent methods
``dataset``      ``WebDataset`` (the seed's call shape and the fluent API)
"""

# The names of the module that ``tarshards.pipeline`` was before the packages (``pipeline.py``, now
# ``pipeline/dataset.py``) stay attributes of the package, imported on first use:
# ``from tarshards.pipeline import X`` still works for them. Submodules are imported as such.

from __future__ import annotations

from .._lazy import names_of

__getattr__ = names_of(
    "tarshards.pipeline",
    "tarshards.pipeline.dataset",
    ["collation", "composition", "dataset", "fusion", "iteration", "stages", "stateful"],
)
