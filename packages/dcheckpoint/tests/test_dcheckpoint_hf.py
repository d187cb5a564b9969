"""Hugging Face interop: ``load_hf`` into a tensor-parallel model, ``export_hf`` for ``from_pretrained``.

The reference is the tiny ``transformers`` model built in this process (same seed, float32,
one thread). Compared quantities and why:

* loaded parameters, as full tensors, bitwise: loading only moves bytes;
* the TP=2 model's loss after ``load_hf`` within 1e-5 relative: the parallel forward sums the
  same terms in another order (row-parallel partial products, sharded softmax), a few ulps
  (the bound of ``test_dtensor_model_ops``);
* ``from_pretrained`` of an export: logits bitwise, the same single-process arithmetic on the
  same bytes;
* bytes read by the group: exactly the checkpoint's tensor bytes (each byte once; the goal
  is <= 1.05x), replicated parameters included;
* the peak RSS of an export in a fresh process: <= largest tensor + 64 MiB (the goal).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import vescale.dtensor.ops  # noqa: F401 - registers the sharding strategies of the TP forward
from vescale.dcheckpoint import (
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    export_hf,
    load_hf,
    save,
)
from vescale.dtensor.mesh import init_mesh
from vescale.dtensor.placements import distribute_tensor
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.memory import fresh_process_peak_growth
from vescale.dtensor.testing.models.tiny_hf import build_tiny_hf_model, tiny_batch
from vescale.dtensor.testing.models.tp_plans import apply_tensor_parallel

LOSS_RTOL = 1e-5


def _reference(name: str, **overrides) -> nn.Module:
    torch.set_num_threads(1)
    return build_tiny_hf_model(name, seed=0, **overrides)


def _loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # No KV cache: one forward, and a cache of DTensors is not what is tested here.
    return model(input_ids=input_ids, labels=labels, use_cache=False).loss


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
        for name, tensor in model.state_dict().items()
    }


def load_hf_into_tp_model_on_ranks(name: str, hf_dir: str) -> dict:
    model = build_tiny_hf_model(name, seed=1)  # other weights: load_hf must replace every one
    apply_tensor_parallel(model, name, init_mesh(tp=dist.get_world_size())["tp"])
    stats = load_hf(model, hf_dir).stats
    input_ids, labels = tiny_batch(model.config.vocab_size)
    loss = _loss(model, input_ids, labels)
    loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
    return {
        "loss": loss,
        "state": _full_state(model),
        "stats": (stats.bytes_read, stats.bytes_received, stats.bytes_needed),
    }


@pytest.mark.parametrize(("name", "max_shard_size"), [("llama", None), ("gpt2", "20KB")])
def test_load_hf_into_a_tensor_parallel_model_matches_the_single_process_model(
    tmp_path, name, max_shard_size
):
    reference = _reference(name)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    reference.save_pretrained(tmp_path / "hf", **kwargs)
    sharded = (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert sharded == (max_shard_size is not None)
    input_ids, labels = tiny_batch(reference.config.vocab_size)
    expected_loss = _loss(reference, input_ids, labels).item()
    per_rank = run_on_ranks(
        load_hf_into_tp_model_on_ranks, 2, args=(name, str(tmp_path / "hf")), timeout_s=300
    )
    expected_state = _full_state(reference)
    # The file holds a tied tensor once (GPT-2's lm_head is its wte), so count each storage once.
    stored = {t.data_ptr(): t for t in reference.state_dict().values()}
    file_bytes = sum(t.numel() * t.element_size() for t in stored.values())
    for rank, result in enumerate(per_rank):
        assert set(result["state"]) == set(expected_state), rank
        for key, expected in expected_state.items():
            assert torch.equal(result["state"][key], expected), (rank, key)
        assert abs(result["loss"] - expected_loss) <= LOSS_RTOL * abs(expected_loss), (
            result["loss"],
            expected_loss,
        )
        bytes_read, bytes_received, bytes_needed = result["stats"]
        assert bytes_read + bytes_received == bytes_needed, rank
    assert sum(result["stats"][0] for result in per_rank) == file_bytes


def test_tied_embeddings_load_through_the_key_the_file_holds(tmp_path):
    reference = _reference("llama", tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    reference.save_pretrained(tmp_path / "hf")
    loaded = build_tiny_hf_model("llama", seed=1, tie_word_embeddings=True)
    load_hf(loaded, tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, expected in _full_state(reference).items():
        assert torch.equal(loaded.state_dict()[key], expected), key
    untied = build_tiny_hf_model("llama", seed=1)
    with pytest.raises(CheckpointMismatchError, match=r"missing 'lm_head.weight'; unexpected none"):
        load_hf(untied, tmp_path / "hf")


def test_load_hf_converts_the_file_dtype_and_refuses_other_shapes(tmp_path):
    reference = _reference("llama")
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    loaded = build_tiny_hf_model("llama", seed=1)
    load_hf(loaded, tmp_path / "hf")
    # bfloat16 -> float32 is exact, so the loaded values are the file's, bit for bit.
    for key, expected in _full_state(reference).items():
        assert loaded.state_dict()[key].dtype == torch.float32, key
        assert torch.equal(loaded.state_dict()[key], expected.float()), key
    wider = build_tiny_hf_model("llama", seed=1, vocab_size=96)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"'lm_head.weight': the Hugging Face file holds shape \(64, 32\), the model has \(96, 32\)",
    ):
        load_hf(wider, tmp_path / "hf")


def save_tp_model_on_ranks(name: str, directory: str) -> None:
    model = build_tiny_hf_model(name, seed=0)
    apply_tensor_parallel(model, name, init_mesh(tp=dist.get_world_size())["tp"])
    save(directory, {"model": model, "step": 3})


@pytest.mark.parametrize(("name", "max_shard_bytes"), [("llama", None), ("gpt2", 20_000)])
def test_export_hf_of_a_tensor_parallel_checkpoint_loads_in_from_pretrained(tmp_path, name, max_shard_bytes):
    import transformers

    run_on_ranks(save_tp_model_on_ranks, 2, args=(name, str(tmp_path / "ckpt")), timeout_s=300)
    reference = _reference(name)
    kwargs = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    written = export_hf(tmp_path / "ckpt", tmp_path / "hf", **kwargs)
    assert (len(written) > 2) == (max_shard_bytes is not None)
    reference.config.save_pretrained(tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for key, expected in _full_state(reference).items():
        assert torch.equal(exported.state_dict()[key], expected), key
    input_ids, _ = tiny_batch(reference.config.vocab_size)
    reference.eval()
    exported.eval()
    with torch.no_grad():
        assert torch.equal(exported(input_ids=input_ids).logits, reference(input_ids=input_ids).logits)


def save_large_on_ranks(
    directory: str, fulls: dict[str, torch.Tensor], placements: dict[str, list[str]]
) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    holder = nn.Module()
    for key, full in fulls.items():
        holder.register_parameter(
            key, nn.Parameter(distribute_tensor(full, mesh, placements[key]), requires_grad=False)
        )
    save(directory, {"model": holder})


def test_export_hf_streams_tensor_by_tensor(tmp_path):
    generator = torch.Generator().manual_seed(4)
    largest = 40 << 20
    fulls = {
        "rows": torch.randn(largest // 4 // 1024, 1024, generator=generator),  # dim-0 chunks: read in place
        "columns": torch.randn(1024, 8 << 10, generator=generator),  # 32 MiB in inner-dim chunks
        "small": torch.randn(64, 64, generator=generator),
    }
    placements = {"rows": ["S(0)"], "columns": ["S(1)"], "small": ["R"]}
    run_on_ranks(save_large_on_ranks, 2, args=(str(tmp_path / "ckpt"), fulls, placements), timeout_s=300)
    # In a fresh process, so that the peak is the export's own.
    growth = fresh_process_peak_growth(
        "from vescale.dcheckpoint import export_hf",
        "export_hf(sys.argv[1], sys.argv[2])",
        str(tmp_path / "ckpt"),
        str(tmp_path / "hf"),
    )
    assert largest <= growth <= largest + (64 << 20), growth >> 20
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(exported) == set(fulls)
    for key, full in fulls.items():
        assert torch.equal(exported[key], full), key


def test_bad_hugging_face_directories_are_refused_with_the_file_named(tmp_path):
    model = nn.Linear(4, 4)
    with pytest.raises(CheckpointNotFoundError, match=r"holds neither model.safetensors nor"):
        load_hf(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"weight": "../x.safetensors"}})
    )
    with pytest.raises(
        CheckpointFormatError, match=r"names '../x.safetensors', which is not a .safetensors file"
    ):
        load_hf(model, tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    torch.manual_seed(0)
    from safetensors.torch import save_file

    save_file(dict(model.state_dict()), tmp_path / "model.safetensors")
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:-8])
    with pytest.raises(CheckpointFormatError, match=r"'model.safetensors' places '(weight|bias)' at bytes"):
        load_hf(model, tmp_path)
