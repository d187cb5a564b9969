"""A bf16 run (fp32 master weights, stages 0-2) saved and resumed continues bitwise.

The fp32 masters carry more precision than the bf16 parameters, so a checkpoint of the model
and the AdamW state alone cannot resume the run: ``DistributedOptimizer.state_dict()`` and
``checkpoint_view()`` hold each master as the state entry ``"master_weight"`` (fp32, the
parameter's global shape; dp-sharded in the view, 1/dp per rank).

Each case trains ``SAVE_STEPS`` steps on dp=2 under one ZeRO stage, saves, and resumes in a
fresh model and optimizer (built from another seed, so nothing but the checkpoint can make
them right) under another stage, through ``state_dict()``/``load_state_dict()`` or by writing
the view's full tensors into the new optimizer's view, then trains ``RESUME_STEPS`` more.
Every run is in deterministic mode with one thread per process, so it does exactly the
arithmetic of the single-process bf16 recipe below (bf16 forward and backward per rank's
micro-batch, fp32 gradients summed in rank order and divided by dp once, fp32 AdamW on the
masters, masters rounded to bf16 into the model; see ``test_doptim_accumulation.py``). The
compared quantities, the saved masters and, after resuming, every bf16 parameter and fp32
master, must therefore equal the recipe's **bitwise** (``torch.equal``). A resume from a state
stripped of ``"master_weight"`` must differ: the check can fail.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dtensor import init_mesh
from vescale.dtensor.testing import run_on_ranks

DP = 2
SAVE_STEPS = 2
RESUME_STEPS = 2
MICRO_BATCH = 3
BUCKET_MB = 400 / 2**20
# (save stage, load stage, how): every stage saves and loads, through both interfaces.
CASES = [(1, 2, "state_dict"), (2, 0, "view"), (0, 1, "view"), (1, 3, "state_dict")]


def build_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def micro_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(MICRO_BATCH, 8, generator=generator)
    return inputs.bfloat16(), torch.randn(MICRO_BATCH, 5, generator=generator).bfloat16()


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def bf16_recipe() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The masters after ``SAVE_STEPS`` steps, then the bf16 parameters and masters at the end."""
    torch.set_num_threads(1)
    model = build_mlp().to(torch.bfloat16)
    masters = {name: param.detach().float() for name, param in model.named_parameters()}
    optimizer = make_optimizer(list(masters.values()))
    saved_masters = {}
    for step in range(SAVE_STEPS + RESUME_STEPS):
        if step == SAVE_STEPS:
            saved_masters = {name: master.clone() for name, master in masters.items()}
        per_rank = []
        for rank in range(DP):
            model.zero_grad()
            inputs, targets = micro_batch(step, rank)
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            per_rank.append({name: param.grad.float() for name, param in model.named_parameters()})
        for name, master in masters.items():
            master.grad = (per_rank[0][name] + per_rank[1][name]).div_(DP)
        optimizer.step()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(masters[name])
    params = {name: param.detach().clone() for name, param in model.named_parameters()}
    return saved_masters, params, {name: master.clone() for name, master in masters.items()}


def _parallel(zero_stage: int, seed: int) -> tuple[torch.nn.Module, DistributedOptimizer]:
    mesh = init_mesh(dp=DP)
    if zero_stage == 3:
        # ZeRO-3's fp32 parameters are the masters; FSDP2 computes in bf16.
        model = data_parallel(
            build_mlp(seed), mesh, zero_stage=3, compute_dtype=torch.bfloat16, deterministic=True
        )
    else:
        model = build_mlp(seed).to(torch.bfloat16)
        data_parallel(model, mesh, zero_stage=zero_stage, deterministic=True, bucket_size_mb=BUCKET_MB)
    return model, DistributedOptimizer(make_optimizer(model.parameters()))


def _train(model: torch.nn.Module, optimizer: DistributedOptimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        inputs, targets = micro_batch(step, dist.get_rank())
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _resume(load_stage: int, how: str, params: dict, saved: dict, full_view_state: dict) -> dict:
    model, optimizer = _parallel(load_stage, seed=1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = params[name].to(param.dtype)
            if isinstance(param, DTensor):
                value = distribute_tensor(value, param.device_mesh, param.placements)
            param.copy_(value)
    if how == "state_dict":
        optimizer.load_state_dict(saved)
    else:
        view = optimizer.checkpoint_view()
        named = dict(model.named_parameters())
        for name, param_state in full_view_state.items():
            view.state[named[name]] = param_state
    _train(model, optimizer, range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS))
    return {
        "params": {name: _full(param) for name, param in model.named_parameters()},
        "masters": {
            name: param_state.get("master_weight", _full(dict(model.named_parameters())[name]))
            for name, param_state in optimizer.state_dict()["state"].items()
        },
    }


def save_and_resume() -> list[dict]:
    results = []
    for save_stage, load_stage, how in CASES:
        model, optimizer = _parallel(save_stage, seed=0)
        _train(model, optimizer, range(SAVE_STEPS))
        params = {name: _full(param) for name, param in model.named_parameters()}
        saved = optimizer.state_dict()
        view = optimizer.checkpoint_view()
        view_layouts, full_view_state = {}, {}
        for name, param in model.named_parameters():
            master_weight = view.state[param]["master_weight"]
            view_layouts[name] = (master_weight.placements, master_weight.to_local().numel())
            full_view_state[name] = {key: _full(value) for key, value in view.state[param].items()}
        stripped = {
            "state": {
                name: {key: value for key, value in state.items() if key != "master_weight"}
                for name, state in saved["state"].items()
            },
            "param_groups": saved["param_groups"],
        }
        results.append(
            {
                "saved_masters": {name: state["master_weight"] for name, state in saved["state"].items()},
                "view_layouts": view_layouts,
                "view_masters": {name: state["master_weight"] for name, state in full_view_state.items()},
                "resumed": _resume(load_stage, how, params, saved, full_view_state),
                "without_masters": _resume(load_stage, "state_dict", params, stripped, {}),
            }
        )
    return results


def _assert_bitwise(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) == set(expected), what
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, (what, name, actual[name].dtype)
        difference = (actual[name].float() - value.float()).abs().max().item()
        assert torch.equal(actual[name], value), (what, name, difference)


def test_bf16_run_resumed_from_its_fp32_masters_continues_bitwise():
    saved_masters, final_params, final_masters = bf16_recipe()
    # The masters are not bf16 values: the bf16 parameters alone do not hold them.
    assert any(not torch.equal(m, m.bfloat16().float()) for m in saved_masters.values())
    for rank, rank_results in enumerate(run_on_ranks(save_and_resume, world_size=DP, timeout_s=240)):
        for (save_stage, load_stage, how), result in zip(CASES, rank_results, strict=True):
            case = f"zero{save_stage}->zero{load_stage} via {how}"
            _assert_bitwise(result["saved_masters"], saved_masters, f"{case}: saved masters")
            _assert_bitwise(result["view_masters"], saved_masters, f"{case}: view masters")
            for name, (placements, local_numel) in result["view_layouts"].items():
                # This rank's dim-0 chunk of the master: 1/dp of it (the split DTensor's Shard(0) makes).
                assert placements == (Shard(0),), (case, name, placements)
                assert local_numel == saved_masters[name].chunk(DP)[rank].numel(), (case, name, local_numel)
            if load_stage != 3:  # ZeRO-3's parameters are the fp32 masters, compared below
                _assert_bitwise(result["resumed"]["params"], final_params, f"{case}: parameters")
            _assert_bitwise(result["resumed"]["masters"], final_masters, f"{case}: masters")
            assert not torch.equal(
                result["without_masters"]["masters"]["0.weight"], final_masters["0.weight"]
            ), f"{case}: resuming without the masters should differ"
