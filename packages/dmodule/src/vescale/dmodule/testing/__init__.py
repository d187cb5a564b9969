"""dmodule's shipped test support: tiny Hugging Face MoE models and their batches.

``transformers`` is a test dependency: it is imported inside the builders only.

Example::

    from vescale.dmodule.testing.moe_models import tiny_moe
    model = tiny_moe("mixtral")
"""
