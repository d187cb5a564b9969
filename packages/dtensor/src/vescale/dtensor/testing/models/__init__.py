"""Small models for veScale's tests: our nanoGPT-style model and tiny ``transformers`` ones.

:mod:`.nanogpt` depends on torch only; :mod:`.tiny_hf` and :mod:`.tp_plans` import
``transformers`` when a Hugging Face model is asked for.

Example::

    from vescale.dtensor.testing.models import NanoGPT, NanoGPTConfig
    model = NanoGPT(NanoGPTConfig())
    logits, _ = model(torch.randint(0, 64, (2, 8)))
"""

from vescale.dtensor.testing.models.nanogpt import NanoGPT, NanoGPTConfig

__all__ = ["NanoGPT", "NanoGPTConfig"]
