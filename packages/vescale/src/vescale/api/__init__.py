"""The unified API of the meta-package (issue #8), one module per concept.

``vescale.deferred_init`` (:mod:`.deferred`), ``vescale.manual_seed`` (:mod:`.seed`),
``vescale.parallelize`` (:mod:`.parallelize`), ``vescale.DistributedDataLoader``
(:mod:`.data_loader`) and ``vescale.save`` / ``vescale.load`` (:mod:`.checkpointing`); the
top-level ``vescale`` package exposes them lazily. This package re-exports nothing, so
``vescale.api.parallelize`` stays the module (it also holds :func:`~.parallelize.mesh_of`).

Example::

    import vescale
    model = vescale.deferred_init(MyModel, config)
    model, optimizer, scheduler, loader = vescale.parallelize(vescale.generate_plan(model), model)
"""

__all__: list[str] = []
