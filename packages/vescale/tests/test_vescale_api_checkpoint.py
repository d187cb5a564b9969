"""``vescale.save`` under one plan, ``vescale.load`` under another, then training continues.

Reference: one process, float32, one thread, the same ``transformers`` model from the same seed,
``torch.optim.AdamW`` and a ``StepLR`` stepped every step, trained on the global batches of
``torch.utils.data.DataLoader(dataset, batch_size=GLOBAL_BATCH)``: ``SAVE_AFTER`` steps, then
``RESUMED`` more. The parallel run trains ``SAVE_AFTER`` steps on 4 ranks under a dp2 x tp2
ZeRO-2 plan built by ``vescale.parallelize``, saves, and a fresh 2-rank run under another plan
loads and trains ``RESUMED`` steps. Llama resumes under two plans (dp2 ZeRO-1, tp2); Mixtral
(experts) and GPT-2 with its embedding tied to the LM head under one each.

Compared quantities and tolerances:
- the state right after the load (every model tensor and optimizer state tensor as a global
  tensor, the optimizer hyper-parameters, the scheduler and loader state) against the state the
  saving run held: bitwise, since a checkpoint only moves values;
- the global batches of the resumed steps against the reference's: bitwise (no arithmetic);
- each step's learning rate against the reference's: bitwise (the same scheduler arithmetic);
- each step's loss and the parameters at the end against the reference: within the issue's
  1e-4 relative (max |parallel - reference| / max |reference|). tp splits matmul sums and dp
  averages two half-batch means, so float32 rounding differs by ~1e-7 per step; AdamW divides
  by each element's own gradient scale, which grows that to ~1e-6 over 10 steps at lr=1e-3
  (test_vescale_dp_tp.py measured 3.6e-6).
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

import vescale
from vescale.api.checkpointing import CheckpointStateError
from vescale.dcheckpoint import CheckpointFormatError
from vescale.doptim import DataParallelPlan
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.planner import Plan

GLOBAL_BATCH = 4
SEQ_LEN = 8
SAVE_AFTER = 3
RESUMED = 5
LOSS_RTOL = 1e-4
PARAM_RTOL = 1e-4
SAVE_PLAN = {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 2}
LOAD_PLANS = {
    "dp2-zero1": {"data_parallel.size": 2, "zero.stage": 1},
    "tp2": {"tensor_parallel.size": 2},
}


def model_config(name: str):
    """The tiny config of ``name``; ``"gpt2-tied"`` shares the embedding with the LM head, and
    ``"gpt2-dropout"`` also keeps GPT-2's default dropout (10% in four places)."""
    if name == "gpt2-tied":
        return tiny_hf_config("gpt2", tie_word_embeddings=True)
    if name == "gpt2-dropout":
        dropout = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
        return tiny_hf_config("gpt2", tie_word_embeddings=True, **dropout)
    return tiny_hf_config(name)


def dataset(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    samples = []
    for _ in range((SAVE_AFTER + RESUMED) * GLOBAL_BATCH):
        ids = torch.randint(0, vocab_size, (SEQ_LEN,), generator=generator)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return samples


def optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def lr_scheduler_fn(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    # Halves the rate every 2 steps: the resumed run must continue the schedule, not restart it.
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def reference_training(name: str) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = model_config(name)
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = optimizer_fn(model)
    loader = torch.utils.data.DataLoader(dataset(config.vocab_size), batch_size=GLOBAL_BATCH)
    # The same plain loop as the parallel runs, on plain PyTorch objects in one process.
    trained = _train(model, optimizer, lr_scheduler_fn(optimizer), loader, SAVE_AFTER + RESUMED)
    return {**trained, "params": {fqn: param.detach().clone() for fqn, param in model.named_parameters()}}


# --- functions that run on the ranks (module level: ranks look them up by name) ---


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _global_state(model, optimizer, scheduler, loader) -> dict:
    optimizer_state = optimizer.state_dict()
    return {
        "model": {fqn: _full(tensor) for fqn, tensor in model.state_dict().items()},
        "optimizer_state": {
            f"{fqn}/{name}": value.clone()
            for fqn, state in optimizer_state["state"].items()
            for name, value in state.items()
        },
        "param_groups": optimizer_state["param_groups"],
        "lr_scheduler": scheduler.state_dict(),
        "data_loader": {key: value for key, value in loader.state_dict().items() if key != "dp_size"},
    }


def data_parallel_plan(size: int, zero_stage: int) -> Plan:
    """A dp-only plan, written out: ``generate_plan`` traces the model for its tp analysis, and
    Mixtral's grouped_mm experts fail that fake-tensor trace on CPU (fp32 has no meta kernel)."""
    return Plan(
        mesh={"dp": size},
        data_parallel=DataParallelPlan(size=size, zero_stage=zero_stage),
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=GLOBAL_BATCH // size,
        sequence_length=SEQ_LEN,
    )


def _build(name: str, plan_or_constraints: Plan | dict):
    config = model_config(name)
    vescale.manual_seed(0)
    model = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, config)
    plan = plan_or_constraints
    if not isinstance(plan, Plan):
        plan = vescale.generate_plan(model, {**plan_or_constraints, "global_batch_size": GLOBAL_BATCH})
    parts = vescale.parallelize(plan, model, optimizer_fn, lr_scheduler_fn, dataset(config.vocab_size))
    return plan, *parts


def _train(model, optimizer, scheduler, loader, steps: int) -> dict:
    losses, lrs, batches = [], [], []
    for batch in loader:
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        batches.append(batch["input_ids"])
        if len(losses) == steps:
            break
    return {"losses": losses, "lrs": lrs, "batches": batches}


def _save_after_training(name: str, path: str, constraints: Plan | dict) -> dict:
    plan, model, optimizer, scheduler, loader = _build(name, constraints)
    trained = _train(model, optimizer, scheduler, loader, SAVE_AFTER)
    state = {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    vescale.save(path, {**state, "data_loader": loader})
    return {**trained, "plan": plan.to_json(), "saved": _global_state(model, optimizer, scheduler, loader)}


def _load_and_continue(name: str, path: str, constraints: Plan | dict) -> dict:
    plan, model, optimizer, scheduler, loader = _build(name, constraints)
    state = {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    saved_plan = vescale.load(path, {**state, "data_loader": loader})
    loaded = _global_state(model, optimizer, scheduler, loader)
    trained = _train(model, optimizer, scheduler, loader, RESUMED)
    params = {fqn: _full(param) for fqn, param in model.module.named_parameters()}
    return {
        **trained,
        "saved_plan": saved_plan.to_json(),
        "plan": plan.to_json(),
        "loaded": loaded,
        "params": params,
    }


# --- tests ---


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _comparable(fqn: str, actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave out GPT-2's key bias (the middle third of ``c_attn.bias``): softmax over keys ignores
    ``q . b_k``, the same for every key, so its gradient is zero in exact arithmetic and rounding
    noise in float32; AdamW normalises that noise to steps of ~lr in a direction no two summation
    orders agree on (measured: 6e-4 relative after 8 steps, while every other tensor stays ~1e-6)."""
    if fqn.endswith("attn.c_attn.bias"):
        width = actual.numel() // 3
        keep = torch.cat([torch.arange(width), torch.arange(2 * width, 3 * width)])
        return actual[keep], expected[keep]
    return actual, expected


def _assert_same_state(loaded: dict, saved: dict) -> None:
    for section in ("model", "optimizer_state"):
        assert loaded[section].keys() == saved[section].keys(), section
        for key, tensor in saved[section].items():
            assert torch.equal(loaded[section][key], tensor), (section, key)
    assert loaded["param_groups"] == saved["param_groups"]
    assert loaded["lr_scheduler"] == saved["lr_scheduler"]
    assert loaded["data_loader"] == saved["data_loader"]


def _check_save_and_resume(name: str, path: str, saved: list[dict], load_plan: str, load_spec) -> None:
    reference = reference_training(name)
    for rank in saved:
        for loss, expected in zip(rank["losses"], reference["losses"][:SAVE_AFTER], strict=True):
            assert abs(loss - expected) <= LOSS_RTOL * abs(expected), (loss, expected)
        assert rank["lrs"] == reference["lrs"][:SAVE_AFTER]
    results = run_on_ranks(_load_and_continue, world_size=2, args=(name, path, load_spec), timeout_s=300)
    for rank, result in enumerate(results):
        assert result["saved_plan"] == saved[0]["plan"] != result["plan"]
        _assert_same_state(result["loaded"], saved[0]["saved"])
        assert result["lrs"] == reference["lrs"][SAVE_AFTER:]
        for loss, expected in zip(result["losses"], reference["losses"][SAVE_AFTER:], strict=True):
            assert abs(loss - expected) <= LOSS_RTOL * abs(expected), (rank, loss, expected)
        worst, worst_fqn = max(
            (_relative(*_comparable(fqn, result["params"][fqn], expected)), fqn)
            for fqn, expected in reference["params"].items()
        )
        assert worst <= PARAM_RTOL, (rank, worst_fqn, worst)
        print(f"{name}, load plan {load_plan}, rank {rank}: final parameters within {worst:.2e} relative")
    if load_plan == "tp2":  # dp=1: both ranks train on the whole global batch
        batches = results[0]["batches"]
        assert all(torch.equal(a, b) for a, b in zip(*(r["batches"] for r in results), strict=True))
    else:
        batches = [torch.cat([result["batches"][step] for result in results]) for step in range(RESUMED)]
    for step, expected in enumerate(reference["batches"][SAVE_AFTER:]):
        assert torch.equal(batches[step], expected), step


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step-3")
    saved = run_on_ranks(_save_after_training, world_size=4, args=("llama", path, SAVE_PLAN), timeout_s=300)
    return path, saved


@pytest.mark.parametrize("load_plan", sorted(LOAD_PLANS))
def test_llama_saved_under_dp2_tp2_zero2_resumes_under_another_plan_like_single_device(
    llama_checkpoint, load_plan
):
    path, saved = llama_checkpoint
    _check_save_and_resume("llama", path, saved, load_plan, LOAD_PLANS[load_plan])


@pytest.mark.parametrize("name", ["mixtral", "gpt2-tied", "gpt2-dropout"])
def test_mixtral_and_tied_gpt2_saved_under_dp4_resume_under_dp2_like_single_device(tmp_path, name):
    # Without tp: these two cannot be sharded over tp yet (Mixtral's grouped_mm experts fail dmodule's
    # fake-tensor trace on CPU; the generated plan shards GPT-2's lm_head but not the embedding tied
    # to it, which parallelize refuses). With GPT-2's dropout, the resumed run's masks are the
    # uninterrupted run's only if the load restores the generator where the save found it
    # (vescale.save keeps it by default): without that, the first resumed loss was 6.3e-4 off.
    path = str(tmp_path / "step-3")
    save_plan = data_parallel_plan(4, zero_stage=2)
    saved = run_on_ranks(_save_after_training, world_size=4, args=(name, path, save_plan), timeout_s=300)
    _check_save_and_resume(name, path, saved, "dp2-zero1", data_parallel_plan(2, zero_stage=1))


PIPELINE_SAVE_PLAN = {
    "pipeline_parallel.size": 2,
    "data_parallel.size": 2,
    "pipeline_parallel.num_microbatches": 2,
    "zero.stage": 1,
}


def rank_groups(rank: dict, index: int) -> list[str]:
    return rank["saved"]["param_groups"][index]["params"]


def _merged_ranks(saved: list[dict]) -> dict:
    """The saving run's state over all ranks: each pp rank holds only its stages' tensors."""
    merged = {**saved[0]["saved"]}
    for section in ("model", "optimizer_state"):
        merged[section] = {key: value for rank in saved for key, value in rank["saved"][section].items()}
    # param_groups list each rank's own FQNs (stage 0's ranks first: the model's order); their
    # hyper-parameters are the same on every rank.
    merged["param_groups"] = [
        {**group, "params": list(dict.fromkeys(fqn for rank in saved for fqn in rank_groups(rank, index)))}
        for index, group in enumerate(saved[0]["saved"]["param_groups"])
    ]
    return merged


def test_a_pp2_plan_saved_on_4_ranks_resumes_on_2_ranks_under_dp2_like_single_device(tmp_path):
    path = str(tmp_path / "step-3")
    args = ("llama", path, PIPELINE_SAVE_PLAN)
    saved = run_on_ranks(_save_after_training, world_size=4, args=args, timeout_s=300)
    merged = [{**saved[0], "saved": _merged_ranks(saved)}]
    _check_save_and_resume("llama", path, merged, "dp2-zero1", LOAD_PLANS["dp2-zero1"])


class ScheduleWithRule(torch.optim.lr_scheduler.StepLR):
    """A scheduler holding a function in its state: it cannot be written as JSON."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, step_size=2)
        self.warmup_rule = lambda step: min(1.0, step / 10)


def test_errors_name_the_problem_and_the_fix(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        CheckpointStateError, match=r"must be a dict with at least \"model\".*got \['optimizer'\]"
    ):
        vescale.save(tmp_path / "a", {"optimizer": optimizer})
    with pytest.raises(CheckpointStateError, match=r'state\["model"\] must be the model .*got dict'):
        vescale.load(tmp_path / "a", {"model": {"weight": model.weight}})
    with pytest.raises(CheckpointStateError, match=r'state\["plan"\] must be a vescale.Plan .*got dict'):
        vescale.save(tmp_path / "b", {"model": model, "plan": {"mesh": {"dp": 2}}})
    with pytest.raises(CheckpointFormatError, match="cannot save 'lr_scheduler/warmup_rule': a function"):
        vescale.save(
            tmp_path / "c",
            {"model": model, "optimizer": optimizer, "lr_scheduler": ScheduleWithRule(optimizer)},
        )


def bf16_plan(zero_stage: int) -> Plan:
    """dp2 in bf16 with fp32 master weights, in doptim's deterministic mode (rank-ordered sums)."""
    section = DataParallelPlan(size=2, zero_stage=zero_stage, mixed_precision="bf16", deterministic=True)
    return Plan(
        mesh={"dp": 2},
        data_parallel=section,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=GLOBAL_BATCH // 2,
        sequence_length=SEQ_LEN,
    )


def _save_and_go_on(name: str, path: str, plan: Plan) -> dict:
    """The uninterrupted bf16 run: save after ``SAVE_AFTER`` steps, then ``RESUMED`` more."""
    plan, model, optimizer, scheduler, loader = _build(name, plan)
    _train(model, optimizer, scheduler, loader, SAVE_AFTER)
    state = {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    vescale.save(path, {**state, "data_loader": loader})
    saved = _global_state(model, optimizer, scheduler, loader)
    return {"saved": saved, "went_on": _train(model, optimizer, scheduler, loader, RESUMED)}


def test_bf16_run_saves_its_fp32_master_weights_and_resumes_bitwise_under_another_zero_stage(tmp_path):
    # The optimizer state holds each bf16 parameter's fp32 master ("master_weight"): loaded bitwise
    # under ZeRO-2 from a ZeRO-1 save. The resumed losses are compared bitwise with the saving run's
    # own continuation: deterministic mode makes ZeRO-1 and ZeRO-2 compute the same sums in the same
    # order (doptim's tests prove both bitwise equal to single-device accumulation), so only state
    # the checkpoint lost could make them differ; masters rebuilt from the bf16 weights would.
    path = str(tmp_path / "step-3")
    saved = run_on_ranks(_save_and_go_on, world_size=2, args=("llama", path, bf16_plan(1)), timeout_s=300)
    masters = [key for key in saved[0]["saved"]["optimizer_state"] if key.endswith("/master_weight")]
    assert masters and all(
        saved[0]["saved"]["optimizer_state"][key].dtype == torch.float32 for key in masters
    )
    results = run_on_ranks(
        _load_and_continue, world_size=2, args=("llama", path, bf16_plan(2)), timeout_s=300
    )
    for rank, result in enumerate(results):
        _assert_same_state(result["loaded"], saved[0]["saved"])
        assert result["losses"] == saved[rank]["went_on"]["losses"], rank


def _save_deferred_and_go_on(name: str, path: str, plan: Plan) -> dict:
    """An async save with deferred copies, then ``RESUMED`` steps at once, then the save's result.

    The saving thread starts its copies 0.3 s late, so that a step that did not wait for them
    would change what they copy."""
    from vescale.dcheckpoint import deferred_staging

    plan, model, optimizer, scheduler, loader = _build(name, plan)
    _train(model, optimizer, scheduler, loader, SAVE_AFTER)
    state = {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}
    saved = _global_state(model, optimizer, scheduler, loader)
    original_run = deferred_staging.DeferredCopies.run

    def late_run(self) -> None:
        time.sleep(0.3)
        original_run(self)

    deferred_staging.DeferredCopies.run = late_run  # this rank process only, restored below
    try:
        pending = vescale.save(path, {**state, "data_loader": loader}, async_save=True, defer_copies=True)
        went_on = _train(model, optimizer, scheduler, loader, RESUMED)
        pending.result(timeout=120)
    finally:
        deferred_staging.DeferredCopies.run = original_run
    return {"saved": saved, "went_on": went_on}


@pytest.mark.parametrize("zero_stage", [1, 3], ids=["zero1", "zero3"])
def test_an_async_save_with_deferred_copies_holds_the_state_of_its_call(tmp_path, zero_stage):
    # The steps right after the save change every parameter; the checkpoint must hold the values
    # of the save() call, bitwise (the optimizer steps wait for the saving thread's copies).
    path = str(tmp_path / "step-3")
    plan = data_parallel_plan(2, zero_stage)
    saved = run_on_ranks(_save_deferred_and_go_on, world_size=2, args=("llama", path, plan), timeout_s=300)
    results = run_on_ranks(_load_and_continue, world_size=2, args=("llama", path, plan), timeout_s=300)
    for rank, result in enumerate(results):
        _assert_same_state(result["loaded"], saved[0]["saved"])
        assert result["losses"] == saved[rank]["went_on"]["losses"], rank
