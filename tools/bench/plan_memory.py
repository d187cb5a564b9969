"""generate_plan's memory estimate per rank against the measured peak of real training steps.

    .venv/bin/python tools/bench/plan_memory.py                    # every plan, 3 AdamW steps
    .venv/bin/python tools/bench/plan_memory.py --plans "dp2 ZeRO-1" "tp2 SP" --steps 2
    .venv/bin/python tools/bench/plan_memory.py --glibc-default    # glibc's dynamic mmap threshold

Each plan is chosen by ``generate_plan(model, constraints, world_size=N)`` for a Llama-shaped
``transformers`` model (14M parameters, float32: tens of MiB of states and activations per rank)
and applied with the component APIs on ``N`` CPU gloo ranks, one thread each:
``vescale.dmodule.deferred_init`` + ``parallelize_module`` with the plan's sharding plan (or
``materialize_module`` without tensor parallelism; pipeline plans through ``vescale.parallelize``,
whose pipeline splits each call into the plan's micro-batches), ``vescale.doptim.data_parallel`` at the
plan's ZeRO stage and ``DistributedOptimizer(AdamW)``, and, when the plan asks for
``activation_checkpointing`` ``"full"`` or ``"selective"``, the checkpointing of each decoder
layer that ``vescale.parallelize`` applies (training calls then pass ``use_cache=False``, as
``vescale.parallelize`` does). Every dp rank trains on its own rows of the global batch.

Measured: the peak resident-set growth per rank over the baseline taken after imports, the
process group, one warm-up step of a tiny model (one-time library set-up: thread pools,
kernels' scratch) and one of a 64-wide model of the same structure under the same plan (the
plan's own one-time set-up: under tp2 12 MiB, constant in the model's width, which the estimate
of tensors does not model), through model set-up and ``--steps`` training steps. The peak is the larger
of the kernel's own high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` at the
baseline, after ``malloc_trim``: no sampling, so no short-lived tensor is missed however loaded
the machine is; the kernel batches its counters, so it may trail by a few hundred KiB) and the
every-millisecond sample of ``PeakResident`` (``vescale.dtensor.testing.memory``), which is
printed next to it. The worst rank is
reported, with what the forward keeps for backward (resident growth over the last forward,
after ``malloc_trim``) next to the estimate's activations of the forward.

Each rank fixes glibc's mmap threshold at 128 KiB first (``--glibc-default`` does not): by
default glibc raises it after every large free, so that freed tensors stay resident as
heap and the resident set measures glibc's caching instead of the tensors alive (up to +30%
here). The estimate models tensors, as a device's allocator reports them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.models.tiny_hf import MEMORY_LLAMA_VOCAB, memory_llama_config

MiB = 2**20
SEQUENCE_LENGTH = 256
MICRO_BATCH = 2
PIPELINE = {
    "pipeline_parallel.size": 2,
    "data_parallel.size": 1,
    "pipeline_parallel.num_microbatches": 4,
    "pipeline_parallel.schedule": "1f1b",
}
# name -> (world size, constraints); sequence length and batch are added for every plan.
PLANS: dict[str, tuple[int, dict]] = {
    "dp2 ZeRO-1": (2, {"data_parallel.size": 2, "zero.stage": 1}),
    "dp2 ZeRO-1 ckpt": (2, {"data_parallel.size": 2, "zero.stage": 1, "activation_checkpointing": "full"}),
    "dp2 ZeRO-1 selective": (
        2,
        {"data_parallel.size": 2, "zero.stage": 1, "activation_checkpointing": "selective"},
    ),
    "dp2 ZeRO-3": (2, {"data_parallel.size": 2, "zero.stage": 3}),
    "tp2 SP": (2, {"tensor_parallel.size": 2, "sequence_parallel": True}),
    "tp2 SP selective": (
        2,
        {"tensor_parallel.size": 2, "sequence_parallel": True, "activation_checkpointing": "selective"},
    ),
    "tp2 SP ckpt": (
        2,
        {"tensor_parallel.size": 2, "sequence_parallel": True, "activation_checkpointing": "full"},
    ),
    "dp2xtp2 SP ZeRO-2": (4, {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 2}),
    # Through vescale.parallelize (torch.distributed.pipelining): 4 micro-batches per step.
    "pp2 1F1B": (2, PIPELINE),
    "pp2 GPipe": (2, {**PIPELINE, "pipeline_parallel.schedule": "gpipe"}),
    "pp2 1F1B ckpt": (2, {**PIPELINE, "activation_checkpointing": "full"}),
    # Chosen by generate_plan alone for a small budget: its measured peak must stay under it.
    "auto, 0.25 GiB": (2, {"memory_per_device_gb": 0.25}),
    "auto, 0.2 GiB": (2, {"memory_per_device_gb": 0.2}),
}


def llama_config(hidden: int = 512):
    """The measured Llama; a smaller ``hidden`` gives the warm-up's model of the same structure."""
    return memory_llama_config(
        hidden, 2 * hidden, num_attention_heads=8, num_key_value_heads=4, sequence_length=SEQUENCE_LENGTH
    )


def _build(plan_json: str, mesh, hidden: int = 512):
    from transformers import LlamaForCausalLM

    from vescale.dmodule import deferred_init, materialize_module, parallelize_module
    from vescale.doptim import data_parallel
    from vescale.planner import Plan

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    model = deferred_init(LlamaForCausalLM, llama_config(hidden))
    if plan.sharding_plan is not None:
        parallelize_module(model, mesh, plan.sharding_plan)
    else:
        materialize_module(model)
    model.train()
    if plan.activation_checkpointing != "none":
        from vescale.api._recompute import checkpoint_repeated_blocks

        checkpoint_repeated_blocks(model, plan.activation_checkpointing)
    if plan.mesh_size("dp") > 1:
        data_parallel(model, mesh, zero_stage=plan.data_parallel.zero_stage)
    return model


def _parallelized(plan_json: str, hidden: int = 512):
    """A pipeline plan's model and optimizer, through ``vescale.parallelize`` (its only way in)."""
    from transformers import LlamaForCausalLM

    import vescale

    plan = vescale.Plan.from_json(plan_json)
    torch.manual_seed(0)
    model = vescale.deferred_init(LlamaForCausalLM, llama_config(hidden))
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.AdamW(module.parameters(), lr=1e-4)
    )
    return model, optimizer


def _train_step(model, optimizer, micro_batches, **call) -> None:
    for input_ids in micro_batches:
        model(input_ids=input_ids, labels=input_ids, **call).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _optimizer(model, plan):
    from vescale.doptim import DistributedOptimizer

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return DistributedOptimizer(optimizer) if plan.mesh_size("dp") > 1 else optimizer


def measure_rank(plan_json: str, steps: int, glibc_default: bool) -> dict:
    from vescale.dtensor import init_mesh
    from vescale.dtensor.testing.memory import (
        PeakResident,
        fix_mmap_threshold,
        high_water_mark_bytes,
        reset_high_water_mark,
        trimmed_resident_bytes,
        warm_up_training,
    )
    from vescale.planner import Plan

    plan = Plan.from_json(plan_json)
    if not glibc_default:
        fix_mmap_threshold()
    mesh = init_mesh(**{dim: size for dim, size in plan.mesh if size > 1})
    warm_up_training()
    dp_rank = mesh.get_local_rank("dp") if plan.mesh_size("dp") > 1 else 0
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(
        0, MEMORY_LLAMA_VOCAB, (plan.global_batch_size, SEQUENCE_LENGTH), generator=generator
    )
    share = plan.global_batch_size // plan.mesh_size("dp")
    micro_batches = rows[dp_rank * share : (dp_rank + 1) * share].split(plan.micro_batch_size)
    # The plan's own one-time set-up (its collectives' and DTensor dispatch's first calls: 12 MiB
    # under tp2 whatever the model's size) on a 64-wide model of the same structure.
    pipelined = plan.mesh_size("pp") > 1
    # vescale.parallelize's pipeline passes use_cache=False itself.
    call = {} if pipelined else {"use_cache": False}
    if pipelined:  # the pipeline splits the rank's rows into its micro-batches itself
        micro_batches = [torch.cat(micro_batches)]
        tiny, tiny_optimizer = _parallelized(plan_json, hidden=64)
    else:
        tiny = _build(plan_json, mesh, hidden=64)
        tiny_optimizer = _optimizer(tiny, plan)
    _train_step(tiny, tiny_optimizer, micro_batches, **call)
    del tiny, tiny_optimizer
    dist.barrier()
    reset_high_water_mark()
    base = trimmed_resident_bytes()
    forward_growth = 0
    with PeakResident() as sampled:
        if pipelined:
            model, optimizer = _parallelized(plan_json)
        else:
            model = _build(plan_json, mesh)
            optimizer = _optimizer(model, plan)
        for _ in range(steps):
            for input_ids in micro_batches:
                before_forward = trimmed_resident_bytes()
                output = model(input_ids=input_ids, labels=input_ids, **call)
                # What the forward keeps (the last step's: the optimizer state exists by then).
                forward_growth = trimmed_resident_bytes() - before_forward
                output.loss.backward()
                del output
            optimizer.step()
            optimizer.zero_grad()
    return {
        "peak": high_water_mark_bytes() - base,
        "sampled peak": sampled.peak - base,
        "forward": forward_growth,
    }


def plan_for(name: str, model) -> tuple[int, object]:
    from vescale.planner import generate_plan

    world_size, constraints = PLANS[name]
    dp = constraints.get("data_parallel.size", world_size)
    microbatches = constraints.get("pipeline_parallel.num_microbatches", 1)
    sizes = {
        "sequence_length": SEQUENCE_LENGTH,
        "micro_batch_size": MICRO_BATCH,
        "global_batch_size": dp * MICRO_BATCH * microbatches,
        "memory_per_device_gb": 64.0,
    }
    return world_size, generate_plan(model, {**sizes, **constraints}, world_size=world_size)


def predicted_forward_activations(model, plan) -> int:
    """What the plan's estimate says the forward keeps for backward on the worst stage."""
    from vescale.planner.memory import stage_sizes
    from vescale.planner.profile import profile_model

    profile = profile_model(model, plan.sequence_length, plan.micro_batch_size)
    return int(max(sizes.activations for sizes in stage_sizes(profile, plan.parallel_choices())))


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--plans", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold (see README)"
    )
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        meta_model = LlamaForCausalLM(llama_config())
    print(
        f"Llama {sum(p.numel() for p in meta_model.parameters()) / 1e6:.1f}M parameters, float32, "
        f"micro-batch {MICRO_BATCH} x {SEQUENCE_LENGTH} tokens per dp rank, {args.steps} AdamW steps, "
        f"glibc mmap threshold {'dynamic' if args.glibc_default else 'fixed at 128 KiB'}\n"
    )
    columns = ["params", "grads", "optimizer", "activations", "temporaries", "estimate", "measured peak"]
    columns += ["sampled", "ratio", "forward keeps (est)", "forward keeps (measured)"]
    rows = ["| plan | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    notes: list[str] = []
    for name in args.plans:
        world_size, plan = plan_for(name, meta_model)
        results = run_on_ranks(
            measure_rank, world_size, args=(plan.to_json(), args.steps, args.glibc_default), timeout_s=600
        )
        # Fresh rank processes for the next plan: nothing of this one (heap arenas, caches) carries over.
        shutdown_rank_pool()
        for growth in results:
            growth["peak"] = max(growth["peak"], growth["sampled peak"])
        worst = max(results, key=lambda growth: growth["peak"])
        estimate = plan.memory_estimate
        cells = [f"{value / MiB:.1f}" for value in estimate.to_dict().values()]
        cells += [f"{value / MiB:.1f}" for value in (estimate.total, worst["peak"], worst["sampled peak"])]
        cells.append(f"{estimate.total / worst['peak']:.3f}")
        forward = max(result["forward"] for result in results)
        # A pipeline's call runs the backward too: what its forward keeps is not measured.
        measured_forward = f"{forward / MiB:.1f}" if plan.mesh_size("pp") == 1 else "-"
        cells += [f"{predicted_forward_activations(meta_model, plan) / MiB:.1f}", measured_forward]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
        if "memory_per_device_gb" in PLANS[name][1]:
            budget = plan.memory_per_device_gb * 2**30
            verdict = "within" if worst["peak"] <= budget else "OVER"
            notes.append(
                f"{name}: generate_plan chose {dict(plan.mesh)}, ZeRO-{plan.data_parallel.zero_stage}, "
                f"checkpointing {plan.activation_checkpointing!r}; measured peak "
                f"{worst['peak'] / MiB:.1f} MiB {verdict} the budget {budget / MiB:.1f} MiB"
            )
    print("\nMiB per rank (worst rank); ratio = estimate / measured peak\n")
    print("\n".join(rows))
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
