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


def _strided_offsets() -> tuple[int, list[int]]:
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    placement = _StridedShard(0, split_factor=2)
    return placement.local_shard_size_and_offset(8, 2, rank=1, offset_mode=_StridedShardOffsetMode.ALL)


def test_strided_shard_offsets_read_an_index_tensor_that_fake_mode_cannot_read():
    # PyTorch computes a _StridedShard's offsets from torch.arange(size).tolist(). When this stops
    # raising under FakeTensorMode, dtensor_bookkeeping_outside_fake_mode is no longer needed.
    real = _strided_offsets()
    with _compat.fake_tensor_mode():
        try:
            _strided_offsets()
        except Exception as error:
            assert type(error).__name__ == "DataDependentOutputException"
        else:
            raise AssertionError("the offsets were read under FakeTensorMode: drop the workaround")
        with _compat.dtensor_bookkeeping_outside_fake_mode():
            assert _strided_offsets() == real
    assert real == (4, [2, 3, 6, 7])


def test_decomposition_strategies_fail_under_fake_mode_and_run_outside_it():
    # An op without a registered strategy (log_sigmoid_forward) gets one from its decomposition;
    # under FakeTensorMode that search finds nothing. When it stops failing, the workaround can go.
    from vescale.dtensor.testing import run_on_ranks

    results = run_on_ranks(_log_sigmoid_under_fake_mode, 1, backend="gloo", timeout_s=60)
    assert results[0] == ("NotImplementedError", "ok")


def _log_sigmoid_under_fake_mode() -> tuple[str, str]:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    sharded = DTensor.from_local(torch.randn(3, 4), mesh, [Shard(0)])
    outcomes = []
    for patched in (False, True):
        with torch.no_grad(), _compat.fake_tensor_mode():
            try:
                if patched:
                    with _compat.dtensor_bookkeeping_outside_fake_mode():
                        output = torch.nn.functional.logsigmoid(sharded)
                    assert output.placements == (Shard(0),) and output.shape == (3, 4)
                else:
                    torch.nn.functional.logsigmoid(sharded)
                outcomes.append("ok")
            except NotImplementedError as error:
                outcomes.append(type(error).__name__)
    return outcomes[0], outcomes[1]


def test_pipeline_stage_metadata_inference_hook_exists_where_torch_builds_tensors_from_metadata():
    # torch 2.13 materialises a later stage's inference inputs in PipelineStage._to_tensor; when
    # that method goes away, pipeline_stage_class must follow PyTorch's new place for it.
    from torch.distributed.pipelining import PipelineStage

    stage_class = _compat.pipeline_stage_class()
    assert issubclass(stage_class, PipelineStage)
    if _compat.torch_version() >= (2, 13):
        assert stage_class is not PipelineStage and "_to_tensor" in stage_class.__dict__


def test_pipeline_stage_hands_over_no_gradient_in_a_forward_only_call():
    # A V-schedule's runtime passes a stage's input gradient to the stage before it on the same rank
    # through these two methods, in eval() too; the repair makes them no-ops without a backward.
    # Where torch renames them, this fails (and test_dpipe_loss_weights.py's ZBV eval with it).
    from torch.distributed.pipelining import PipelineStage

    stage_class = _compat.pipeline_stage_class()
    for method in ("get_local_bwd_output", "set_local_bwd_input"):
        assert callable(getattr(PipelineStage, method, None)), f"PipelineStage.{method} is gone"
        assert method in stage_class.__dict__


def test_bookkeeping_wrappers_are_restored_when_passes_overlap():
    # Two fake passes (threads, or one nested in another) share the class attributes: the last
    # one out, whichever it is, puts PyTorch's methods back.
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.__dict__["local_shard_size_and_offset"]
    first, second = (
        _compat.dtensor_bookkeeping_outside_fake_mode(),
        _compat.dtensor_bookkeeping_outside_fake_mode(),
    )
    first.__enter__()
    second.__enter__()
    assert _StridedShard.__dict__["local_shard_size_and_offset"] is not original
    first.__exit__(None, None, None)
    assert _StridedShard.__dict__["local_shard_size_and_offset"] is not original
    second.__exit__(None, None, None)
    assert _StridedShard.__dict__["local_shard_size_and_offset"] is original
