"""Pipeline-parallel checkpoints load into other pipeline sizes, splits and plans.

A tiny untied ``transformers`` Llama (eight blocks; GPT-2 for tied weights) trains 2 AdamW
steps under pp2 (and pp2 x tp2) with ``vescale.doptim.DistributedOptimizer``, saves model and optimizer
(``checkpoint_view()``) with ``vescale.dcheckpoint.save``, and takes a third step: the
uninterrupted run. The checkpoint is then loaded by one process into the plain model and
``torch.optim.AdamW`` (pp1): that read is the reference for the saved state. Quantities compared:

- every model tensor and optimizer state tensor after loading into pp4 and into tp2 without
  pp, gathered whole, against the single-process read: bitwise (a checkpoint only moves bytes);
- the loss of the step after the load against the uninterrupted run's third loss. Pipeline
  stages run the same operations as one process accumulating the same 4 micro-batches in the
  same order, then dividing the gradients by 4 once (issue 6), so pp1 (that accumulation),
  pp2 and pp4 are bitwise equal for the untied Llama in float32 with one thread. tp2 splits the
  matmul sums and pp2 x tp2 saves come from such sums: within 1e-4 relative (issue 6's bound;
  ~1e-7 per step of float32 reordering, measured in test_vescale_pp_tp.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from vescale.dcheckpoint import load, save
from vescale.dpipe import PipelinePlan, pipeline_parallelize
from vescale.dpipe.testing import build_model
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

BATCH_SIZE = 8
SEQ_LEN = 8
NUM_MICROBATCHES = 4
LEARNING_RATE = 1e-2
LOSS_RTOL = 1e-4


def batches(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab_size, (BATCH_SIZE, SEQ_LEN), generator=generator) for _ in range(3)]


def _parallel_model(mesh_dims: dict[str, int], model_name: str = "llama"):
    """``model_name`` under ``mesh_dims`` (``dp``, maybe ``pp``/``tp``) and its DistributedOptimizer."""
    from vescale.doptim import DistributedOptimizer, data_parallel

    mesh = init_mesh(**mesh_dims)
    model = build_model(model_name)
    if "tp" in mesh_dims:
        import vescale.dmodule

        tp_plan = vescale.dmodule.auto_sharding_plan(model)  # ties GPT-2's embedding to its head
        vescale.dmodule.parallelize_module(model, mesh, tp_plan, mesh_dim="tp")
    if "pp" in mesh_dims:
        plan = PipelinePlan(size=mesh_dims["pp"], schedule="1f1b", num_microbatches=NUM_MICROBATCHES)
        model = pipeline_parallelize(model, mesh, plan)
    data_parallel(model, mesh, zero_stage=1, mesh_dim="dp")
    optimizer = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
    return model, optimizer


def _step(model, optimizer, input_ids: torch.Tensor, pipelined: bool) -> float:
    if pipelined:
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        loss = out.loss.detach()
    else:
        micro_losses = []
        for micro_ids in input_ids.chunk(NUM_MICROBATCHES):
            micro_loss = model(input_ids=micro_ids, labels=micro_ids, use_cache=False).loss
            micro_loss.backward()
            micro_losses.append(micro_loss.detach())
        for parameter in model.parameters():
            parameter.grad.div_(NUM_MICROBATCHES)
        loss = torch.stack(micro_losses).sum() / NUM_MICROBATCHES
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_save_and_continue(path: str, mesh_dims: dict[str, int], model_name: str = "llama") -> float:
    """Rank function: 2 steps, save, a third step (the uninterrupted run); returns its loss."""
    model, optimizer = _parallel_model(mesh_dims, model_name)
    steps = batches(build_model(model_name).config.vocab_size)
    for input_ids in steps[:2]:
        _step(model, optimizer, input_ids, pipelined="pp" in mesh_dims)
    save(path, {"model": model, "optimizer": optimizer.checkpoint_view()})
    return _step(model, optimizer, steps[2], pipelined="pp" in mesh_dims)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def load_and_continue(path: str, mesh_dims: dict[str, int], model_name: str = "llama") -> dict:
    """Rank function: load under ``mesh_dims``; the whole tensors this rank holds, and the next loss."""
    model, optimizer = _parallel_model(mesh_dims, model_name)
    load(path, {"model": model, "optimizer": optimizer.checkpoint_view()})
    view = optimizer.checkpoint_view()
    fqn_of = {id(param): fqn for fqn, param in model.named_parameters()}
    loaded = {
        "model": {fqn: _whole(tensor) for fqn, tensor in model.state_dict().items()},
        "optimizer": {
            f"{fqn_of[id(param)]}/{name}": _whole(value)
            for param, param_state in view.state.items()
            for name, value in param_state.items()
        },
    }
    input_ids = batches(build_model(model_name).config.vocab_size)[2]
    return {**loaded, "loss": _step(model, optimizer, input_ids, pipelined="pp" in mesh_dims)}


def single_process_read(path: str, model_name: str = "llama") -> dict:
    """The checkpoint loaded into the plain model and AdamW (pp1), and the next step's loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(model_name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        load(path, {"model": model, "optimizer": optimizer})
        fqn_of = {id(param): fqn for fqn, param in model.named_parameters()}
        saved = {
            "model": {fqn: tensor.clone() for fqn, tensor in model.state_dict().items()},
            "optimizer": {
                f"{fqn_of[id(param)]}/{name}": value.clone()
                for param, param_state in optimizer.state.items()
                for name, value in param_state.items()
            },
        }
        assert optimizer.param_groups[0]["lr"] == LEARNING_RATE
        input_ids = batches(model.config.vocab_size)[2]
        return {**saved, "loss": _step(model, optimizer, input_ids, pipelined=False)}
    finally:
        torch.set_num_threads(threads)


def _assert_same_state(loaded: dict, saved: dict) -> None:
    for section in ("model", "optimizer"):
        assert loaded[section], section
        for key, tensor in loaded[section].items():
            assert torch.equal(tensor, saved[section][key]), (section, key)


@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory) -> tuple[str, float, dict]:
    path = str(tmp_path_factory.mktemp("pp2") / "step-2")
    uninterrupted = run_on_ranks(train_save_and_continue, 2, args=(path, {"pp": 2, "dp": 1}), timeout_s=300)
    assert uninterrupted[0] == uninterrupted[1]
    return path, uninterrupted[0], single_process_read(path)


def test_pp2_checkpoint_loads_into_one_process_and_continues_bitwise(pp2_checkpoint):
    _, uninterrupted_loss, saved = pp2_checkpoint
    assert len(saved["model"]) == len(dict(build_model("llama").named_parameters()))
    assert saved["loss"] == uninterrupted_loss


@pytest.mark.parametrize(
    ("world_size", "mesh_dims", "bitwise"),
    [(4, {"pp": 4, "dp": 1}, True), (2, {"dp": 1, "tp": 2}, False)],
    ids=["pp4", "tp2"],
)
def test_pp2_checkpoint_loads_into_another_pipeline_size_or_tp_bitwise(
    pp2_checkpoint, world_size, mesh_dims, bitwise
):
    path, uninterrupted_loss, saved = pp2_checkpoint
    results = run_on_ranks(load_and_continue, world_size, args=(path, mesh_dims), timeout_s=300)
    covered = set()
    for result in results:
        _assert_same_state(result, saved)
        covered |= set(result["model"]) | set(result["optimizer"])
        if bitwise:
            assert result["loss"] == uninterrupted_loss
        else:
            assert abs(result["loss"] - uninterrupted_loss) <= LOSS_RTOL * abs(uninterrupted_loss)
    assert covered == set(saved["model"]) | set(saved["optimizer"])


def test_pp2_tp2_checkpoint_loads_into_one_process(tmp_path):
    path = str(tmp_path / "step-2")
    dims = {"pp": 2, "dp": 1, "tp": 2}
    uninterrupted = run_on_ranks(train_save_and_continue, 4, args=(path, dims), timeout_s=300)
    saved = single_process_read(path)
    assert abs(saved["loss"] - uninterrupted[0]) <= LOSS_RTOL * abs(uninterrupted[0])


def test_tied_gpt2_pp2_checkpoint_holds_one_optimizer_state_and_loads_into_one_process_and_pp4(tmp_path):
    # GPT-2's wte and lm_head are one parameter: stage 0 holds it as transformer.wte.weight, the
    # last stage as lm_head.weight. Its optimizer state must be saved under the name it has
    # without a pipeline, so that pp1 (which lists the parameter once) and pp4 load it strictly.
    # The tied copies' gradients are summed across stages, not accumulated in one autograd pass
    # as in one process, so losses are compared within 1e-4 relative; loaded state bitwise.
    path = str(tmp_path / "step-2")
    uninterrupted = run_on_ranks(
        train_save_and_continue, 2, args=(path, {"pp": 2, "dp": 1}, "gpt2"), timeout_s=300
    )
    saved = single_process_read(path, "gpt2")
    assert not any(key.startswith("lm_head.weight/") for key in saved["optimizer"])
    assert abs(saved["loss"] - uninterrupted[0]) <= LOSS_RTOL * abs(uninterrupted[0])
    results = run_on_ranks(load_and_continue, 4, args=(path, {"pp": 4, "dp": 1}, "gpt2"), timeout_s=300)
    for result in results:
        _assert_same_state(result, saved)
        assert abs(result["loss"] - uninterrupted[0]) <= LOSS_RTOL * abs(uninterrupted[0])
