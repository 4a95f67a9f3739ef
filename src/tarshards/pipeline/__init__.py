"""Pipelines: a source and its stages.

``stages``       stateless stages (generator functions) and the stages with a position
``stateful``     stages that hold a position, with explicit saveable state
``fusion``       the stage record and the one rewrite of a stage list
``collation``    collations (padded, packed) and the array-type registry
``composition``  ``DataPipeline``: a source and stages, the fluent methods
``dataset``      ``WebDataset`` (the seed's call shape and the fluent API)
"""
