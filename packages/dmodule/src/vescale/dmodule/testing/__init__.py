"""dmodule's shipped test support: tiny Hugging Face MoE models and their batches
(``moe_models``), and one step of a parallelized model checked against its reference
(``step_errors``).

``transformers`` is a test dependency: it is imported inside the builders only.

Example::

    from vescale.dmodule.testing.moe_models import tiny_moe
    model = tiny_moe("mixtral")
"""
