"""Every private PyTorch API that vescale.dpipe uses still exists and behaves as relied on."""

from __future__ import annotations

import torch

from vescale.dpipe import _compat


def test_fake_tensor_mode_makes_storage_free_tensors_from_real_inputs():
    real_weight = torch.ones(3, 2)
    with _compat.fake_tensor_mode():
        fake_input = torch.empty(5, 3)
        product = fake_input @ real_weight
    assert product.shape == (5, 2)
    assert type(product).__name__ == "FakeTensor"


def test_private_api_error_names_the_supported_torch_range():
    error = _compat._missing("torch._subclasses.fake_tensor.FakeTensorMode")
    assert isinstance(error, _compat.PrivateTorchAPIError)
    assert "checked against torch 2.11 to 2.13" in str(error)
