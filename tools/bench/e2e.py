"""End-to-end step time: ``vescale.parallelize`` vs a hand-written PyTorch 2-D set-up, eager vs compile.

    .venv/bin/python tools/bench/e2e.py                 # dp2 x tp2 on 4 CPU ranks, tiny Llama
    .venv/bin/python tools/bench/e2e.py --steps 10 --repeats 3
    .venv/bin/python tools/bench/e2e.py --variants "vescale dp2×tp2 sdpa" "vescale dp2×tp2 sdpa selective"

Variants, each on the same 4 gloo ranks (one thread each), the same ``transformers`` Llama
(``--hidden`` wide, ``--layers`` deep, seed 0) and the same batches (``--batch`` rows of
``--seq`` tokens per dp rank):

* ``native``: PyTorch only — ``torch.distributed.tensor.parallel.parallelize_module`` with the
  Megatron plan of ``vescale.dtensor.testing.models.tp_plans`` over ``tp``, then FSDP2
  ``fully_shard`` on every decoder layer and the root over ``dp``; ``torch.optim.AdamW``;
* ``vescale``: ``vescale.generate_plan(model, {dp 2, tp 2, ZeRO-3, no SP})`` and
  ``vescale.parallelize(plan, model, optimizer_fn)``;
* ``vescale dp2×tp2 sdpa`` and ``vescale dp2×tp2 sdpa+compile``: the same plan, eager and with
  ``compile=True`` (with tensor parallelism,
  each decoder layer is compiled on its own; the rest runs eagerly), with ``sdpa`` attention:
  torch 2.13 cannot trace eager attention's 4-D ``matmul`` on head-sharded DTensors of a 2-D mesh
  ("Sharding propagation failed for aten.bmm.default" on ``_StridedShard`` under fake tensors);
* ``vescale dp4`` and ``vescale dp4+compile``: eager vs ``compile=True`` on a dp4 plan (ZeRO-0,
  the whole model compiled);
* ``vescale dp2×tp2 sdpa selective`` and ``... full``, eager and ``+compile``: the sdpa plan with
  ``activation_checkpointing`` ``"selective"`` (backward recomputes no matmul) and ``"full"``
  (backward recomputes each layer whole): what recomputation costs per step.

Step time is fwd + bwd + optimizer step + ``zero_grad`` between barriers, the slowest rank's,
median over ``--steps`` steps after ``--warmup`` warm-up steps (compilation happens there).
``--repeats`` interleaves the variants so that load from other processes hits each alike; the
table gives the median over repeats and the ratio to ``native`` (goal: vescale <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import vescale
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.models.tp_plans import apply_tensor_parallel

COMPILED_TP = "vescale dp2×tp2 sdpa+compile"
EAGER_SDPA = "vescale dp2×tp2 sdpa"  # the compiled row's eager twin
RECOMPUTED = {f"{base} {mode}": mode for base in (EAGER_SDPA, COMPILED_TP) for mode in ("selective", "full")}
VARIANTS = ("native", "vescale", EAGER_SDPA, COMPILED_TP, "vescale dp4", "vescale dp4+compile", *RECOMPUTED)


def _config(hidden: int, layers: int, attention: str = "eager") -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        # Stock DTensor has no strategy for the CPU flash-attention op (native needs "eager").
        attn_implementation=attention,
        tie_word_embeddings=False,
    )


def _optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _native(config: transformers.LlamaConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    apply_tensor_parallel(model, "llama", mesh["tp"], sequence_parallel=False)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, _optimizer_fn(model)


def _vescale(
    config: transformers.LlamaConfig, constraints: dict, compile_model: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    vescale.manual_seed(0)
    model = vescale.deferred_init(transformers.LlamaForCausalLM, config)
    plan = vescale.generate_plan(model, constraints)
    model, optimizer, _, _ = vescale.parallelize(plan, model, _optimizer_fn, compile=compile_model)
    return model, optimizer


def step_seconds(
    variant: str, hidden: int, layers: int, batch: int, seq: int, warmup: int, steps: int
) -> float:
    """The median step time of ``variant`` on this rank's share (all ranks agree after the max-reduce)."""
    config = _config(hidden, layers, "sdpa" if variant.startswith((COMPILED_TP, EAGER_SDPA)) else "eager")
    dp = 4 if "dp4" in variant else 2
    if variant == "native":
        model, optimizer = _native(config)
    else:
        constraints = {"data_parallel.size": 4, "zero.stage": 0}
        if dp == 2:
            constraints = {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 3}
            constraints["sequence_parallel"] = False  # the native set-up has none
            constraints["activation_checkpointing"] = RECOMPUTED.get(variant, "none")
        constraints.update({"global_batch_size": dp * batch, "micro_batch_size": batch})
        model, optimizer = _vescale(config, constraints, compile_model="+compile" in variant)
    # Each dp rank's own rows (the tp ranks of one dp rank share them).
    generator = torch.Generator().manual_seed(dist.get_rank() // (4 // dp))
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    times = []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        optimizer.step()
        dist.barrier()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="rows per dp rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    variants = ["native", *(variant for variant in args.variants if variant != "native")]
    shape = (args.hidden, args.layers, args.batch, args.seq, args.warmup, args.steps)
    seconds: dict[str, list[float]] = {variant: [] for variant in variants}
    try:
        for _ in range(args.repeats):
            for variant in variants:
                seconds[variant].append(
                    run_on_ranks(step_seconds, 4, args=(variant, *shape), timeout_s=900)[0]
                )
    finally:
        shutdown_rank_pool()
    native = statistics.median(seconds["native"])
    tokens = f"{args.batch}x{args.seq} tokens per dp rank"
    meshes = "native and vescale: dp2 x tp2; dp4 rows: dp4"
    print(f"Llama hidden={args.hidden} layers={args.layers}, {tokens}, {args.repeats} repeat(s); {meshes}")
    print("| variant | step time (ms), median of repeats | min-max (ms) | ratio to native |")
    print("|---|---|---|---|")
    for variant in variants:
        median = statistics.median(seconds[variant])
        spread = f"{min(seconds[variant]) * 1e3:.1f}-{max(seconds[variant]) * 1e3:.1f}"
        print(f"| {variant} | {median * 1e3:.1f} | {spread} | {median / native:.2f} |")


if __name__ == "__main__":
    main()
