"""Expert parallelism through ``vescale.parallelize`` trains like one device (issue #19).

Mixtral, Qwen3-MoE and DeepSeek-V3, tiny (``vescale.dmodule.testing.moe_models``: 8 experts,
top-2, ``output_router_logits=True`` so the load-balancing loss is in the loss, every other
field at the architecture's default), on 4 gloo ranks under the plans ep4, ep2 x dp2 (ZeRO-1
and ZeRO-3), ep2 x tp2 (tensor parallelism outside the experts) and pp2 x ep2 (an MoE layer in
each pipeline stage). The global batch of each step (8 sequences) is split over dp x ep; the
reference is one process training the whole global batch with the same optimizer.

Compared: every parameter's gradient after step 1 (read from the parallel model: under ZeRO-3
FSDP2's sharded gradients, gathered) against the reference's, bound 1e-5 relative (float32 sums
in another order: the grouped GEMM's rows, the dp x ep all-reduce; measured worst ~2e-6); the
global loss of every step against the reference's, bound 1e-4 relative (the issue's, measured
worst ~1e-6 over 20 steps); each rank's share of the expert parameters (local numel = 1/ep).

``STEPS`` is small in CI (``VESCALE_EP_STEPS`` raises it, 20 for the issue's acceptance), and
CI runs three of the fifteen model x plan cells (``VESCALE_EP_ALL_CELLS=1``: all of them, dp4 with
the experts replicated included). AdamW runs at lr 1e-3: at 1e-2 DeepSeek-V3 under ep2 x dp2
ZeRO-1 left the single-device curve by 2.5e-3 within 20 steps (measured once; not analysed).

Composition cells (tiny Mixtral, SGD): ep2 x dp2 ZeRO-1 with full activation checkpointing,
ep4 under ``torch.compile``, ep2 x tp2 with sequence parallelism and ep2 x tp2 with expert tensor
parallelism (each rank's experts split over tp too: 1/4 of the expert parameters per rank);
measured worst over 20 steps: losses 6.7e-7, first-step gradients 5.0e-7 relative.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from vescale.dmodule.testing.moe_models import batch_shard, global_batch, tiny_moe
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.numerics import gradient_errors, relative_error

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-4
STEPS = int(os.environ.get("VESCALE_EP_STEPS", "2"))
GLOBAL_BATCH = 8

PLANS = {
    "ep4": {"mesh": {"ep": 4}, "zero_stage": 0},
    "ep2xdp2-zero1": {"mesh": {"dp": 2, "ep": 2}, "zero_stage": 1},
    "ep2xdp2-zero3": {"mesh": {"dp": 2, "ep": 2}, "zero_stage": 3},
    "ep2xtp2": {"mesh": {"ep": 2, "tp": 2}, "zero_stage": 0},
    # Expert tensor parallelism: the experts split over tp inside each expert too.
    "ep2xtp2-etp": {"mesh": {"ep": 2, "tp": 2}, "zero_stage": 0, "expert_tp": True},
    # Experts replicated: vescale.parallelize makes the load-balancing loss the global batch's.
    "dp4": {"mesh": {"dp": 4}, "zero_stage": 0},
}


def _plan(model: torch.nn.Module, spec: dict):
    """The plan of one cell of :data:`PLANS` or :data:`COMPOSED_PLANS` (absent options: the defaults)."""
    from vescale.dmodule import plan_tensor_parallel
    from vescale.doptim.plan import DataParallelPlan
    from vescale.planner import Plan

    mesh = spec["mesh"]
    sequence_parallel = spec.get("sequence_parallel", False)
    sharding_plan = None
    if mesh.get("tp", 1) > 1:
        sharding_plan = plan_tensor_parallel(model, sequence_parallel=sequence_parallel).plan
    return Plan(
        mesh=mesh,
        data_parallel=DataParallelPlan(size=mesh.get("dp", 1), zero_stage=spec["zero_stage"]),
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=GLOBAL_BATCH // (mesh.get("dp", 1) * mesh.get("ep", 1)),
        sharding_plan=sharding_plan,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=spec.get("recompute", "none"),
        expert_tensor_parallel=spec.get("expert_tp"),
    )


def _optimizer(kind: str):
    if kind == "sgd":
        return lambda model: torch.optim.SGD(model.parameters(), lr=0.5)
    return lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _batches(steps: int, first_step: int = 0, mesh=None) -> list[dict]:
    """The batches of steps ``first_step ..`` (step ``s`` trains on global batch ``s + 1``): the whole
    global batch, or with ``mesh`` this rank's share of it over dp x ep."""
    batches = []
    for step in range(first_step, first_step + steps):
        ids = global_batch(seed=step + 1, batch_size=GLOBAL_BATCH)
        if mesh is not None:
            ids = batch_shard(ids, mesh, ("dp", "ep"))
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def _train_like_one_device(name: str, key: str, optimizer_kind: str, steps: int) -> dict:
    import vescale
    from vescale.doptim import clip_grad_norm_

    reference = tiny_moe(name)
    model = copy.deepcopy(reference)
    plan = _plan(model, PLANS[key])
    model, optimizer, _, _ = vescale.parallelize(plan, model, _optimizer(optimizer_kind))
    mesh = model.mesh
    reference_optimizer = _optimizer(optimizer_kind)(reference)

    # Each rank's share of the expert parameters: 1/ep, and 1/dp of that again under ZeRO-3 (1/tp
    # with expert tensor parallelism).
    share = plan.mesh_size("ep") * (plan.mesh_size("dp") if plan.data_parallel.zero_stage == 3 else 1)
    share *= plan.mesh_size("tp") if plan.experts_split_over_tp else 1
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for n, p in model.module.named_parameters()
        if ".experts." in n
    )
    total = sum(p.numel() for n, p in reference.named_parameters() if ".experts." in n)
    result = {"local_expert_numel": local, "expert_numel": total, "share": share}
    result.update(losses=[], reference=[])
    for step in range(steps):
        ids = global_batch(seed=step + 1, batch_size=GLOBAL_BATCH)
        local_ids = batch_shard(ids, mesh, ("dp", "ep"))
        loss = model(input_ids=local_ids, labels=local_ids).loss
        loss.backward()
        reference_loss = reference(input_ids=ids, labels=ids).loss
        reference_loss.backward()
        if step == 0:
            optimizer.prepare_grads()
            result["grad"] = max(gradient_errors(model.module, reference).values())
            # The global gradient norm counts every expert shard, ZeRO chunk and replica once.
            norm = clip_grad_norm_(optimizer, max_norm=1e9)
            result["norm"] = relative_error(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
        result["losses"].append(float(loss.detach()))
        result["reference"].append(float(reference_loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    result["loss"] = max(
        relative_error(torch.tensor(a), torch.tensor(b))
        for a, b in zip(result["losses"], result["reference"], strict=True)
    )
    return result


# CI runs three cells (ep2 x tp2 goes through vescale.parallelize in the deferred-init test, and its
# gradients are checked in dmodule's tests); VESCALE_EP_ALL_CELLS=1 runs every model under every plan.
CELLS = [
    ("mixtral", "ep4", "sgd"),
    ("qwen3_moe", "ep2xdp2-zero1", "adamw"),
    ("deepseek_v3", "ep2xdp2-zero3", "sgd"),
]
if os.environ.get("VESCALE_EP_ALL_CELLS") == "1":
    CELLS = [
        (name, key, "sgd" if key in ("ep4", "ep2xdp2-zero3", "dp4") else "adamw")
        for name in ("mixtral", "qwen3_moe", "deepseek_v3")
        for key in PLANS
    ]


@pytest.mark.parametrize(("name", "key", "optimizer_kind"), CELLS, ids=["-".join(cell) for cell in CELLS])
def test_expert_parallel_plan_trains_like_one_device(name, key, optimizer_kind):
    results = run_on_ranks(_train_like_one_device, 4, (name, key, optimizer_kind, STEPS))
    worst = {k: max(r[k] for r in results) for k in ("grad", "loss", "norm")}
    print(f"{name} {key} {optimizer_kind}: {worst}, local expert numel {results[0]['local_expert_numel']}")
    for rank, result in enumerate(results):
        assert result["local_expert_numel"] * result["share"] == result["expert_numel"], (rank, result)
        assert result["grad"] <= GRAD_RTOL and result["norm"] <= GRAD_RTOL, (
            rank,
            result["grad"],
            result["norm"],
        )
        assert result["loss"] <= LOSS_RTOL, (rank, result["losses"], result["reference"])


# Expert parallelism composed with the other options of a plan (the deliverable 4), one cell
# each on tiny Mixtral with SGD: full activation checkpointing (the recomputed forward of each block
# exchanges its counts and tokens again, in backward), torch.compile (the whole model; dynamo breaks
# the graph around the data-dependent dispatch) and sequence parallelism outside the experts.
COMPOSED_PLANS = {
    "ep2xdp2-zero1-full-recompute": {"mesh": {"dp": 2, "ep": 2}, "zero_stage": 1, "recompute": "full"},
    "ep4-compile": {"mesh": {"ep": 4}, "zero_stage": 0, "compile": True},
    "ep2xtp2-sequence-parallel": {"mesh": {"ep": 2, "tp": 2}, "zero_stage": 0, "sequence_parallel": True},
    # Expert tensor parallelism: each rank's E/ep experts split over tp inside each expert too.
    "ep2xtp2-expert-tensor-parallel": {"mesh": {"ep": 2, "tp": 2}, "zero_stage": 0, "expert_tp": True},
}
COMPOSED_SGD_LR = 0.5


def _composed_run(name: str, key: str, steps: int) -> dict:
    import vescale
    from vescale.dmodule.experts import expert_parallel_state
    from vescale.dtensor.testing.numerics import full_gradients

    torch.set_num_threads(1)
    model = tiny_moe(name)
    model, optimizer, _, _ = vescale.parallelize(
        _plan(model, COMPOSED_PLANS[key]),
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=COMPOSED_SGD_LR),
        compile=COMPOSED_PLANS[key].get("compile", False),
    )
    # Each experts module's forward calls of the first step (a recomputed block runs its forward again).
    forwards: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda module, args, fqn=fqn: forwards.append(fqn))
        for fqn, module in model.module.named_modules()
        if expert_parallel_state(module) is not None
    ]
    local = sum(p.to_local().numel() for n, p in model.module.named_parameters() if ".experts." in n)
    total = sum(p.numel() for n, p in model.module.named_parameters() if ".experts." in n)
    losses, gradients = [], {}
    for step, batch in enumerate(_batches(steps, mesh=model.mesh)):
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            optimizer.prepare_grads()  # the dp x ep reductions done: every gradient as the optimizer steps it
            gradients = full_gradients(model.module)
            for handle in handles:
                handle.remove()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "gradients": gradients,
        "experts_forwards": len(forwards),
        "expert_share": local / total,
    }


@pytest.mark.parametrize("key", list(COMPOSED_PLANS))
def test_expert_parallel_composes_with(key):
    """Every rank's loss of every step within 1e-4 relative of one process training the global batches,
    every parameter's first-step gradient within 1e-5 relative (tiny Mixtral, SGD)."""
    from vescale.dtensor.testing.reference import assert_runs_match_reference, train_reference

    name = "mixtral"
    reference = train_reference(
        lambda: tiny_moe(name),
        _batches(STEPS),
        lambda m: torch.optim.SGD(m.parameters(), lr=COMPOSED_SGD_LR),
    )
    runs = run_on_ranks(_composed_run, 4, (name, key, STEPS), timeout_s=300)
    errors = assert_runs_match_reference(
        reference, runs, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL, label=f"{name} {key}"
    )
    forwards = [run["experts_forwards"] for run in runs]
    print(f"{name} {key}: loss {errors[0]:.2e}, first-step gradient {errors[1]:.2e}, forwards {forwards}")
    # Two MoE layers, each dispatching once in forward, and once more in backward when recomputed.
    recomputed = COMPOSED_PLANS[key].get("recompute", "none") != "none"
    assert forwards == [2 * (2 if recomputed else 1)] * 4
    # Each rank holds 1/ep of the expert parameters, and 1/tp of that with expert tensor parallelism.
    mesh = COMPOSED_PLANS[key]["mesh"]
    share = 1 / (mesh["ep"] * (mesh.get("tp", 1) if COMPOSED_PLANS[key].get("expert_tp") else 1))
    assert [run["expert_share"] for run in runs] == [share] * 4


def test_compile_with_expert_and_tensor_parallelism_is_refused():
    """torch 2.13 cannot compile ep x tp (AOT autograd replays a DTensor view with as_strided around the
    eager dispatch; measured on ep2 x tp2): a typed error naming both sizes and the fix, before any work."""
    import vescale
    from vescale.api.errors import UnsupportedPlanError

    model = tiny_moe("mixtral")
    with pytest.raises(UnsupportedPlanError, match=r"ep=2, tp=2.*use compile=False, or compile with tp=1"):
        vescale.parallelize(_plan(model, COMPOSED_PLANS["ep2xtp2-sequence-parallel"]), model, compile=True)


# pp2 x ep2: two pipeline stages, each an ep2 group over which the global batch is split; each
# stage holds one MoE layer (DeepSeek-V3 gets a third layer, as its first is dense). One
# micro-batch per rank (GPipe): the load-balancing statistic is then the whole global batch's, as
# on one device (with more micro-batches it is each micro-batch's, as in gradient accumulation).
# The routers' statistics travel from stage to stage with the hidden state.
PIPELINE_SGD_LR = 0.5
# One SGD step reads the applied gradient back, (before - after) / lr, with ~ulp(after) / lr of
# rounding: at 1e3 that was 3.6e-6 relative on DeepSeek-V3's q_a_layernorm weights (gradients
# ~1e-5); at 1e4 the worst is 5.8e-7. Measured worst over 20 steps: losses 7.6e-6 (Qwen3-MoE),
# first-step gradients 5.8e-7 (DeepSeek-V3).
GRADIENT_SGD_LR = 1e4
# All three in CI: ~2 s each once the ranks are up (measured on 2 loaded cores).
PIPELINE_MODELS = ("mixtral", "qwen3_moe", "deepseek_v3")


def _pipeline_model(name: str) -> torch.nn.Module:
    return tiny_moe(name, num_hidden_layers=3) if name == "deepseek_v3" else tiny_moe(name)


def _pipeline_plan():
    from vescale.doptim.plan import DataParallelPlan
    from vescale.dpipe import PipelinePlan
    from vescale.planner import Plan

    return Plan(
        mesh={"pp": 2, "ep": 2},
        data_parallel=DataParallelPlan(size=1),
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=GLOBAL_BATCH // 2,
        pipeline=PipelinePlan(size=2, schedule="gpipe", num_microbatches=1),
    )


def _pipeline_expert_parallel_run(name: str, steps: int) -> dict:
    import vescale
    from vescale.dtensor.testing.numerics import full_parameters, sgd_step_gradients
    from vescale.dtensor.testing.reference import train_steps

    torch.set_num_threads(1)
    model, optimizer, _, _ = vescale.parallelize(
        _pipeline_plan(), _pipeline_model(name), lambda m: torch.optim.SGD(m.parameters(), lr=PIPELINE_SGD_LR)
    )
    experts = {n: p for n, p in model.module.named_parameters() if ".experts." in n}
    local_expert_numel = sum(p.to_local().numel() for p in experts.values())
    stage_expert_numel = sum(p.numel() for p in experts.values())
    losses = train_steps(model, optimizer, _batches(steps, mesh=model.mesh))
    # The first step's gradients, from one SGD step at a large rate on a fresh copy.
    model, optimizer, _, _ = vescale.parallelize(
        _pipeline_plan(), _pipeline_model(name), lambda m: torch.optim.SGD(m.parameters(), lr=GRADIENT_SGD_LR)
    )
    before = full_parameters(model)
    train_steps(model, optimizer, _batches(1, mesh=model.mesh))
    return {
        "losses": losses,
        "gradients": sgd_step_gradients(before, full_parameters(model), GRADIENT_SGD_LR),
        "expert_share": local_expert_numel / stage_expert_numel,
    }


@pytest.mark.parametrize("name", PIPELINE_MODELS)
def test_pp2_ep2_trains_like_one_device(name):
    """Every rank's loss of every step within 1e-4 relative of one process training the global batches
    (the issue's bound); every parameter's first-step gradient, over both stages, within 1e-5 relative
    (float32 sums in another order: the grouped GEMM's rows, the ep all-reduce); each rank holds half
    of its stage's expert parameters."""
    from vescale.dtensor.testing.reference import assert_runs_match_reference, train_reference

    reference = train_reference(
        lambda: _pipeline_model(name),
        _batches(STEPS),
        lambda m: torch.optim.SGD(m.parameters(), lr=PIPELINE_SGD_LR),
    )
    runs = run_on_ranks(_pipeline_expert_parallel_run, 4, (name, STEPS), timeout_s=300)
    errors = assert_runs_match_reference(
        reference, runs, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL, label=f"{name} pp2xep2"
    )
    print(f"{name} pp2xep2: loss {errors[0]:.2e}, first-step gradient {errors[1]:.2e}")
    assert [run["expert_share"] for run in runs] == [0.5] * 4


def _deferred_experts_are_the_single_device_slices(key: str) -> dict:
    import transformers

    import vescale

    eager = tiny_moe("mixtral")
    torch.manual_seed(0)  # tiny_moe's seed: the same draws as eager construction
    deferred = vescale.deferred_init(transformers.AutoModelForCausalLM.from_config, eager.config)
    deferred.train()
    model, _, _, _ = vescale.parallelize(_plan(eager, PLANS[key]), deferred)
    mesh = model.mesh
    ep_rank, ep = mesh.get_local_rank("ep"), mesh.size(mesh.mesh_dim_names.index("ep"))
    reference = dict(eager.named_parameters())
    checked = 0
    for fqn, param in model.module.named_parameters():
        if ".experts." not in fqn:
            continue
        per_rank = reference[fqn].shape[0] // ep
        expected = reference[fqn].detach()[ep_rank * per_rank : (ep_rank + 1) * per_rank]
        # With expert tensor parallelism the local tensor is a tp slice of that: the full tensor is checked.
        assert PLANS[key].get("expert_tp") or torch.equal(param.to_local(), expected), fqn
        checked += 1
    # Everything else is bitwise single-device construction too, and the model trains like it.
    for fqn, param in model.module.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        assert torch.equal(value.detach(), reference[fqn].detach()), fqn
    ids = global_batch(seed=1, batch_size=GLOBAL_BATCH)
    local_ids = batch_shard(ids, mesh, ("dp", "ep"))
    loss = model(input_ids=local_ids, labels=local_ids).loss
    return {
        "experts_checked": checked,
        "loss": relative_error(loss.detach(), eager(input_ids=ids, labels=ids).loss),
    }


@pytest.mark.parametrize("key", ["ep4", "ep2xtp2", "ep2xtp2-etp"])
def test_deferred_init_materialises_each_ranks_experts_only(key):
    """Each rank's experts are bitwise the same slice of a single-device init (the TP plan leaves them)."""
    results = run_on_ranks(_deferred_experts_are_the_single_device_slices, 4, (key,))
    print(f"deferred {key}:", results[0])
    for result in results:
        assert result["experts_checked"] == 4 and result["loss"] <= LOSS_RTOL, result


def _clip_plain_parameters_beside_experts() -> dict:
    from vescale.dmodule.experts import average_gradients, parallelize_experts
    from vescale.doptim import clip_grad_norm_
    from vescale.dtensor import init_mesh

    reference = tiny_moe("qwen3_moe")
    model = copy.deepcopy(reference)
    mesh = init_mesh(dp=2, ep=2)
    parallelize_experts(model, mesh)  # experts DTensors over ep, every other parameter a plain tensor
    ids = global_batch(seed=1, batch_size=GLOBAL_BATCH)
    local_ids = batch_shard(ids, mesh, ("dp", "ep"))
    model(input_ids=local_ids, labels=local_ids).loss.backward()
    average_gradients(model, mesh)
    reference(input_ids=ids, labels=ids).loss.backward()
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    norm = clip_grad_norm_(model.parameters(), 0.1)
    return {
        "norm": relative_error(norm, reference_norm),
        "grad": max(gradient_errors(model, reference).values()),
    }


def test_clip_grad_norm_counts_plain_parameters_beside_experts_once():
    """Before the fix the plain (non-expert) gradients were summed over every rank of the mesh: the norm
    came out 2x and more; now the norm and the clipped gradients equal one device's."""
    results = run_on_ranks(_clip_plain_parameters_beside_experts, 4)
    print("clip beside experts dp2xep2:", results[0])
    for result in results:
        assert result["norm"] <= GRAD_RTOL and result["grad"] <= GRAD_RTOL, result


CHECKPOINT_MODEL = "mixtral"
SAVED_AFTER = 2  # SGD steps before the save
CONTINUED = 2  # SGD steps after the load


def _sgd_curve(model: torch.nn.Module, first_step: int, steps: int) -> list[float]:
    """Single-device SGD losses of global batches ``first_step ..`` (the reference's batches)."""
    from vescale.dtensor.testing.reference import train_steps

    return train_steps(model, _optimizer("sgd")(model), _batches(steps, first_step))


def _parallel_curve(model, optimizer, first_step: int, steps: int) -> list[float]:
    from vescale.dtensor.testing.reference import train_steps

    return train_steps(model, optimizer, _batches(steps, first_step, model.mesh))


def _ep_model(ep: int, seed: int):
    import vescale
    from vescale.doptim.plan import DataParallelPlan
    from vescale.planner import Plan

    plan = Plan(
        mesh={"ep": ep},
        data_parallel=DataParallelPlan(size=1),
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=GLOBAL_BATCH // ep,
    )
    model, optimizer, _, _ = vescale.parallelize(
        plan, tiny_moe(CHECKPOINT_MODEL, seed=seed), _optimizer("sgd")
    )
    return model, optimizer


def _save_at_ep4(directory: str) -> None:
    import vescale
    from vescale.dtensor.testing.numerics import full_parameters

    model, optimizer = _ep_model(4, seed=0)  # the reference's weights
    _parallel_curve(model, optimizer, 0, SAVED_AFTER)
    vescale.save(f"{directory}/step-{SAVED_AFTER}", {"model": model})
    saved = full_parameters(model.module)
    if torch.distributed.get_rank() == 0:
        torch.save(saved, f"{directory}/saved_parameters.pt")


def _load_and_continue(directory: str, ep: int | None) -> dict:
    import vescale
    from vescale.dtensor.testing.numerics import full_parameters

    if ep is None:  # one process, no parallelism: the plain model
        model = tiny_moe(CHECKPOINT_MODEL, seed=7)
        vescale.load(f"{directory}/step-{SAVED_AFTER}", {"model": model})
        loaded = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
        losses = _sgd_curve(model, SAVED_AFTER, CONTINUED)
    else:
        model, optimizer = _ep_model(ep, seed=7)
        vescale.load(f"{directory}/step-{SAVED_AFTER}", {"model": model})
        loaded = full_parameters(model.module)
        losses = _parallel_curve(model, optimizer, SAVED_AFTER, CONTINUED)
    saved = torch.load(f"{directory}/saved_parameters.pt")
    reference = tiny_moe(CHECKPOINT_MODEL)
    curve = _sgd_curve(reference, 0, SAVED_AFTER + CONTINUED)[SAVED_AFTER:]
    return {
        "bitwise": all(torch.equal(loaded[fqn], saved[fqn]) for fqn in saved)
        and loaded.keys() == saved.keys(),
        "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, curve, strict=True)),
    }


def test_checkpoint_saved_at_ep4_loads_at_ep2_and_one_process_and_as_hugging_face(tmp_path):
    """ep4 saves after 2 SGD steps; ep2 (2 ranks) and one plain process load it bit for bit and continue on
    the single-device curve (losses of steps 3-4 within 1e-4 relative); the Hugging Face export of it
    loads with from_pretrained, bit for bit. Each expert tensor is one tensor of its global shape."""
    import transformers

    from vescale.dcheckpoint import read_index
    from vescale.dcheckpoint.hf import export_hf

    directory = str(tmp_path)
    run_on_ranks(_save_at_ep4, 4, (directory,))
    index = read_index(tmp_path / f"step-{SAVED_AFTER}")
    for name, record in index.tensors.items():
        if ".experts." in name:
            # One tensor of the global shape (8 experts), its chunks holding every element once.
            assert record.shape[0] == 8, (name, record.shape)
            assert sum(chunk.box.numel for chunk in record.chunks) == math.prod(record.shape), name
    for ep, world in ((2, 2), (None, 1)):
        results = run_on_ranks(_load_and_continue, world, (directory, ep))
        print(f"load at ep={ep} on {world} ranks:", results[0])
        for result in results:
            assert result["bitwise"] and result["loss"] <= LOSS_RTOL, result
    export_hf(tmp_path / f"step-{SAVED_AFTER}", tmp_path / "hf")
    tiny_moe(CHECKPOINT_MODEL).config.save_pretrained(tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    saved = torch.load(tmp_path / "saved_parameters.pt")
    for fqn, param in exported.named_parameters():
        assert torch.equal(param.detach(), saved[fqn]), fqn


def _adamw_model(mesh: dict[str, int], zero_stage: int):
    import vescale
    from vescale.doptim.plan import DataParallelPlan
    from vescale.planner import Plan

    dp, ep = mesh.get("dp", 1), mesh.get("ep", 1)
    plan = Plan(
        mesh=mesh,
        data_parallel=DataParallelPlan(size=dp, zero_stage=zero_stage),
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=GLOBAL_BATCH // (dp * ep),
    )
    model, optimizer, _, _ = vescale.parallelize(plan, tiny_moe("qwen3_moe"), _optimizer("adamw"))
    return model, optimizer


def _save_adamw_at_ep2xdp2(directory: str) -> list[float]:
    import vescale

    model, optimizer = _adamw_model({"dp": 2, "ep": 2}, 1)
    _parallel_curve(model, optimizer, 0, SAVED_AFTER)
    vescale.save(f"{directory}/adamw", {"model": model, "optimizer": optimizer})
    return _parallel_curve(model, optimizer, SAVED_AFTER, CONTINUED)


def _resume_adamw(directory: str, mesh: dict[str, int], zero_stage: int) -> list[float]:
    import vescale

    model, optimizer = _adamw_model(mesh, zero_stage)
    vescale.load(f"{directory}/adamw", {"model": model, "optimizer": optimizer})
    return _parallel_curve(model, optimizer, SAVED_AFTER, CONTINUED)


def test_adamw_state_saved_at_ep2xdp2_zero1_resumes_at_ep4(tmp_path):
    """The optimizer state (AdamW moments, ZeRO-1 chunks over dp x ep for the rest, over dp for the
    experts) saved at ep2 x dp2 resumes at ep4 ZeRO-0 on the curve the uninterrupted run continued on."""
    continued = run_on_ranks(_save_adamw_at_ep2xdp2, 4, (str(tmp_path),))[0]
    resumed = run_on_ranks(_resume_adamw, 4, (str(tmp_path), {"ep": 4}, 0))[0]
    print("AdamW continued:", continued, "resumed at ep4:", resumed)
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, continued, strict=True)) <= LOSS_RTOL
