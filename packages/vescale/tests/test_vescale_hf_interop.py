"""``load_hf`` into models parallelized by several components: ZeRO-3 (FSDP2, with and without
tensor parallel) and pipeline parallel.

The reference is ``transformers``' ``from_pretrained`` of the same directory in this process
(float32, one thread). Every rank builds the model with other weights (seed 1), parallelizes
it and calls ``load_hf``. Compared quantities and why:

* every parameter this rank holds, as a full tensor (``full_tensor`` of its DTensor),
  bitwise against ``from_pretrained``'s: loading only moves bytes;
* bytes read: each rank reads only byte ranges of its own shards, each once
  (``bytes_read + bytes_received == bytes_needed``), and the group reads each file byte once
  (its sum of ``bytes_read`` is the checkpoint's tensor bytes; a tied tensor held by two
  pipeline stages under two names is read by each, which the sum states exactly);
* the logits of a forward pass after loading. ZeRO-3 alone and pipeline stages run the same
  single-device arithmetic on the same bytes (FSDP2 gathers whole parameters; a stage runs
  whole layers): bitwise. With tensor parallelism the matmuls sum their partial products in
  another order (row-parallel layers): within 1e-5 relative, a few float32 ulps (the bound of
  ``test_dcheckpoint_hf``); relative means max |parallel - reference| / max |reference|.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import vescale.dmodule
from vescale.dcheckpoint import CheckpointMismatchError, load_hf
from vescale.doptim import data_parallel
from vescale.dpipe import PipelinePlan, pipeline_parallelize
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model

TP_LOGITS_RTOL = 1e-5
BATCH, SEQ_LEN = 4, 8


def _input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(5))


def _build(name: str, seed: int) -> nn.Module:
    if name == "gpt2":
        return build_tiny_hf_model("gpt2", seed=seed, n_layer=4, tie_word_embeddings=True)
    return build_tiny_hf_model("llama", seed=seed, num_hidden_layers=4)


def _reference(name: str, hf_dir) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Save a model as Hugging Face does, then its ``from_pretrained``: state, logits, file bytes."""
    import transformers

    torch.set_num_threads(1)
    _build(name, seed=0).save_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = model(input_ids=_input_ids(model.config.vocab_size), use_cache=False).logits
    # save_pretrained writes one copy of a tied tensor: the file's bytes are the distinct tensors'.
    distinct = {id(p): p for p in model.state_dict(keep_vars=True).values()}.values()
    file_bytes = sum(p.numel() * p.element_size() for p in distinct)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, logits, file_bytes


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _result(model: nn.Module, stats, logits: torch.Tensor | None) -> dict:
    return {
        "state": {name: _full(tensor) for name, tensor in model.state_dict().items()},
        "stats": (stats.bytes_read, stats.bytes_received, stats.bytes_needed),
        "logits": None if logits is None else _full(logits),
    }


def zero3_load_on_ranks(name: str, hf_dir: str, tensor_parallel: bool) -> dict:
    mesh = init_mesh(dp=2, tp=2) if tensor_parallel else init_mesh(dp=dist.get_world_size())
    model = _build(name, seed=1)
    if tensor_parallel:
        vescale.dmodule.parallelize_module(model, mesh, vescale.dmodule.auto_sharding_plan(model))
    data_parallel(model, mesh, zero_stage=3)
    stats = load_hf(model, hf_dir).stats
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_input_ids(model.config.vocab_size), use_cache=False).logits
    return _result(model, stats, logits)


def pipeline_load_on_ranks(name: str, hf_dir: str) -> dict:
    model = _build(name, seed=1)
    pipe = pipeline_parallelize(model, init_mesh(pp=2), PipelinePlan(size=2, num_microbatches=2))
    # Strict: the key check runs over both stages, each holding half of the file's keys.
    stats = load_hf(pipe, hf_dir).stats
    pipe.eval()
    with torch.no_grad():
        logits = pipe(input_ids=_input_ids(model.config.vocab_size)).logits
    return _result(pipe, stats, logits)


def _check_loaded(per_rank: list[dict], reference_state: dict[str, torch.Tensor]) -> None:
    for rank, result in enumerate(per_rank):
        for key, tensor in result["state"].items():
            assert torch.equal(tensor, reference_state[key]), (rank, key)
        bytes_read, bytes_received, bytes_needed = result["stats"]
        assert bytes_read + bytes_received == bytes_needed, (rank, result["stats"])


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).abs().max() / reference.abs().max()).item()


def test_load_hf_into_zero3_matches_from_pretrained(tmp_path):
    state, logits, file_bytes = _reference("llama", tmp_path / "hf")
    per_rank = run_on_ranks(
        zero3_load_on_ranks, 2, args=("llama", str(tmp_path / "hf"), False), timeout_s=300
    )
    _check_loaded(per_rank, state)
    for result in per_rank:
        assert set(result["state"]) == set(state)
        assert torch.equal(result["logits"], logits)
    assert sum(result["stats"][0] for result in per_rank) == file_bytes


def test_load_hf_into_zero3_over_tensor_parallel_matches_from_pretrained(tmp_path):
    # FSDP2 shards tp-sharded dims within each tp shard (placements (_StridedShard, Shard)).
    state, logits, file_bytes = _reference("llama", tmp_path / "hf")
    per_rank = run_on_ranks(zero3_load_on_ranks, 4, args=("llama", str(tmp_path / "hf"), True), timeout_s=300)
    _check_loaded(per_rank, state)
    for result in per_rank:
        assert set(result["state"]) == set(state)
        assert _relative(result["logits"], logits) <= TP_LOGITS_RTOL
    assert sum(result["stats"][0] for result in per_rank) == file_bytes


def test_load_hf_into_pipeline_stages_matches_from_pretrained(tmp_path):
    # GPT-2 ties lm_head to wte: the file holds wte only, and the stages hold one each.
    state, logits, file_bytes = _reference("gpt2", tmp_path / "hf")
    per_rank = run_on_ranks(pipeline_load_on_ranks, 2, args=("gpt2", str(tmp_path / "hf")), timeout_s=300)
    _check_loaded(per_rank, state)
    first, last = (set(result["state"]) for result in per_rank)
    assert "transformer.wte.weight" in first and "lm_head.weight" in last
    assert first | last == set(state) and not first & last
    assert per_rank[0]["logits"] is None
    assert torch.equal(per_rank[1]["logits"], logits)
    tied_bytes = state["lm_head.weight"].numel() * 4  # read by both stages, under their own names
    assert sum(result["stats"][0] for result in per_rank) == file_bytes + tied_bytes


def pipeline_load_missing_on_ranks(hf_dir: str) -> str:
    model = _build("llama", seed=1)
    pipe = pipeline_parallelize(model, init_mesh(pp=2), PipelinePlan(size=2, num_microbatches=2))
    try:
        load_hf(pipe, hf_dir)
    except CheckpointMismatchError as error:
        return str(error)
    return "no error"


def test_a_key_missing_on_one_stage_fails_load_hf_on_every_rank(tmp_path):
    import safetensors.torch

    state, _, _ = _reference("llama", tmp_path / "hf")
    # The file without the last stage's final norm: only rank 1 misses a key, both must raise.
    del state["model.norm.weight"]
    safetensors.torch.save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    messages = run_on_ranks(pipeline_load_missing_on_ranks, 2, args=(str(tmp_path / "hf"),), timeout_s=300)
    for message in messages:
        assert "missing 'model.norm.weight' (on rank 1)" in message, message
        assert "unexpected none" in message, message
