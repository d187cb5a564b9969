"""End-to-end step time and memory: ``vescale.parallelize`` vs hand-written torchtitan-style PyTorch.

    .venv/bin/python tools/bench/e2e.py                 # dp2 x tp2 and dp4 on 4 CPU ranks, tiny Llama
    .venv/bin/python tools/bench/e2e.py --steps 3 --blocks 5
    .venv/bin/python tools/bench/e2e.py --pairs "vescale dp2×tp2 sdpa" "vescale dp2×tp2 sdpa selective"

Variants, each on the same 4 gloo ranks (one thread each, fresh rank processes per run), the
same ``transformers`` Llama (``--hidden`` wide, ``--layers`` deep, seed 0) and the same batches
(``--batch`` rows of ``--seq`` tokens per dp rank). Native sides are what a PyTorch engineer
would write, after torchtitan's ``parallelize`` for Llama:

* ``native`` / ``native sdpa`` (eager / sdpa attention): ``parallelize_module`` over ``tp`` with
  local outputs — vocabulary-parallel embedding (``RowwiseParallel``), ``ColwiseParallel`` q/k/v
  and gate/up, ``RowwiseParallel`` o/down, the attention's and MLP's input prepared once as a
  Replicate DTensor (``PrepareModuleInput(use_local_output=False)``, so each branch's input
  gradient is all-reduced once), the LM head column-parallel with gathered logits (the loss is
  ``transformers``' own, inside the model) — then FSDP2 ``fully_shard`` per decoder layer
  (resharding after forward except the last) and the root over ``dp``; ``torch.optim.AdamW``;
* ``native sdpa+compile``: the same, each decoder layer ``torch.compile``d after TP and before
  FSDP2 (torchtitan's order);
* ``native dp4`` / ``native dp4+compile``: ``DistributedDataParallel`` (gradients as bucket
  views, 25 MB buckets), the compiled one through ``torch.compile`` of the DDP module;
* the native loss (``--native-loss``): ``rank-mean`` (the default, and the checked baseline)
  averages each rank's mean loss, DDP's and FSDP2's gradient average: no collective, one
  device's gradients while every rank's labels count the same tokens (as here, unpadded).
  ``global-tokens`` does the job veScale's side does, one device's gradients with padded labels
  too, as torchtitan's trainer (``global_valid_tokens``) and ``transformers``' Trainer
  (``average_tokens_across_devices``) do: one all-reduce of the rank's label tokens over ``dp``
  before the forward, the model's loss the rank's sum over that count (``num_items_in_batch``)
  times ``dp`` (DDP's and FSDP2's averages divide by it again; torchtitan turns FSDP2's division
  off instead, a ``PREMUL_SUM`` that gloo cannot run);
* ``vescale`` (eager attention), ``vescale dp2×tp2 sdpa`` and ``... sdpa+compile``:
  ``vescale.generate_plan(model, {dp 2, tp 2, ZeRO-3, no SP})`` and
  ``vescale.parallelize(plan, model, optimizer_fn, compile=...)`` (with tensor parallelism
  each decoder layer is compiled on its own);
* ``vescale dp4`` and ``vescale dp4+compile``: a dp4 ZeRO-0 plan (the whole model compiled);
* ``native pp4 1f1b`` / ``vescale pp4 1f1b``: a 4-stage pipeline (sdpa), cut before decoder
  layers ``L/4``, ``2L/4`` and ``3L/4``, PyTorch's 1F1B over ``--batch`` one-row micro-batches:
  ``torch.distributed.pipelining`` with hand-written stages (``native_pipeline.py``: torchtitan's
  recipe on ``transformers``' module names) against ``vescale.parallelize`` of a plan with the
  same cuts and schedule (``pipeline_parallel.split_points``), which runs the model's own forward
  per stage;
* ``native pp2×dp2 1f1b`` / ``vescale pp2×dp2 1f1b``: the same with 2 stages (cut before layer
  ``L/2``), each data-parallel over 2 ranks: the native stages are ``DistributedDataParallel``
  modules (PyTorch's stage defers their all-reduce to the last micro-batch's backward), ours a
  ZeRO-0 plan;
* ``vescale dp2×tp2 sdpa selective`` / ``full`` (and ``+compile``), run only when named:
  what recomputation costs per step, against the sdpa row without it.

Each pair runs in its own fresh 4 rank processes: the native side is built and warmed up
(``--warmup`` steps, compilation included), then ours, then the two alternate ``--blocks``
blocks of ``--steps`` steps (A B A B ...), so that load from other processes on the machine
hits both alike. Step time is fwd + bwd + optimizer step + ``zero_grad`` between barriers,
the slowest rank's; a block's time is its median step. The ratio is the median of the
per-block ratios with their min-max (goal: <= 1.00). Memory is each side's worst-rank peak
growth of malloc's bytes in use (``PeakHeapInUse``: the goal's figure; the resident set's
beside it) over its build and ``--warmup`` steps (weights, optimizer state, activations),
measured in a run of its own in fresh rank processes, after that side built a 1-layer, 64-wide
twin of the model and ran one step with it: each side's imports and one-time set-up then sit
in the baseline, not in the model's figure (cold, vescale's dp4 peak growth was 105.7 MiB
against 92.6, 1.14x, of which 34 and 26 MiB were one-time: vescale's build imports 149 more
modules).
"""

from __future__ import annotations

import gc
import json
import statistics
import time

import torch
import torch.distributed as dist
import transformers
from native_pipeline import NativePipeline, global_label_tokens
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import vescale
from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.memory import PeakHeapInUse, PeakResident

MiB = 1 << 20

COMPILED_TP = "vescale dp2×tp2 sdpa+compile"
EAGER_SDPA = "vescale dp2×tp2 sdpa"  # the compiled row's eager twin
RECOMPUTED = {f"{base} {mode}": mode for base in (EAGER_SDPA, COMPILED_TP) for mode in ("selective", "full")}
# (ours, native baseline): the checked pairs.
PAIRS = (
    ("vescale", "native"),
    (EAGER_SDPA, "native sdpa"),
    (COMPILED_TP, "native sdpa+compile"),
    ("vescale dp4", "native dp4"),
    ("vescale dp4+compile", "native dp4+compile"),
    ("vescale pp4 1f1b", "native pp4 1f1b"),
    ("vescale pp2×dp2 1f1b", "native pp2×dp2 1f1b"),
)
# Recomputation rows are measured against the same plan without recomputation.
OURS_TO_NATIVE = {
    **dict(PAIRS),
    **{name: EAGER_SDPA if "compile" not in name else COMPILED_TP for name in RECOMPUTED},
}


def _config(hidden: int, layers: int, attention: str = "eager") -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attn_implementation=attention,
    )


def _pipeline_stages(variant: str) -> int:
    """The pipeline size of ``variant`` (1: no pipeline)."""
    return 4 if "pp4" in variant else 2 if "pp2" in variant else 1


def _data_parallel(variant: str) -> int:
    """The data-parallel size of ``variant`` (of 4 ranks)."""
    if "pp4" in variant:
        return 1
    return 4 if "dp4" in variant else 2


def _data_parallel_rank(variant: str) -> int:
    """This rank's index on ``dp``: meshes are laid out pp, dp, tp (``vescale.dtensor.MESH_DIM_ORDER``)."""
    dp = _data_parallel(variant)
    tp = 4 // (dp * _pipeline_stages(variant))
    return dist.get_rank() // tp % dp


def _sdpa(variant: str) -> bool:
    return any(name in variant for name in ("sdpa", "dp4", "pp4", "pp2"))


def _cuts(layers: int, stages: int) -> tuple[int, ...]:
    """The decoder layers the pipeline's stages after the first start at (uniform)."""
    if layers < stages:
        raise ValueError(f"a {stages}-stage pipeline needs at least {stages} layers, got {layers}")
    return tuple(stage * layers // stages for stage in range(1, stages))


def _optimizer_fn(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _torchtitan_tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """torchtitan's Llama TP plan (no sequence parallelism) on ``transformers``' module names."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # Vocabulary-parallel head with gathered logits: transformers computes the loss inside.
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for layer in model.model.layers:
        # One Replicate DTensor per branch input: q/k/v (gate/up) read it, their input gradients
        # add up as one Partial DTensor and are all-reduced once per branch.
        plan = {
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Replicate()},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=False,
            ),
            "mlp": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            ),
            **{f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
            "mlp.down_proj": RowwiseParallel(),
        }
        parallelize_module(layer, tp_mesh, plan)


class TokenNormalized:
    """A native model whose loss is normalized by the global batch's label tokens (torchtitan's
    ``global_valid_tokens``, ``transformers``' Trainer's ``average_tokens_across_devices``)."""

    def __init__(self, model: torch.nn.Module, dp_group: dist.ProcessGroup, dp: int):
        self.model, self.dp_group, self.dp = model, dp_group, dp

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's loss: the sum of its token losses over the global batch's token count."""
        terms = global_label_tokens(input_ids, self.dp_group)
        output = self.model(input_ids=input_ids, labels=input_ids, use_cache=False, num_items_in_batch=terms)
        return output.loss * self.dp  # the data-parallel average divides by dp again


def _native(
    variant: str, config: transformers.LlamaConfig, batch: int, native_loss: str
) -> tuple[torch.nn.Module | NativePipeline | TokenNormalized, torch.optim.Optimizer]:
    torch.manual_seed(0)
    stages = _pipeline_stages(variant)
    global_tokens = native_loss == "global-tokens"
    if stages > 1:
        dp = _data_parallel(variant)
        mesh = init_device_mesh("cpu", (stages, dp), mesh_dim_names=("pp", "dp"))
        pipeline = NativePipeline.build(
            config,
            mesh["pp"],
            cuts=_cuts(config.num_hidden_layers, stages),
            schedule="1f1b",
            microbatches=batch,
            dp_group=mesh.get_group("dp") if dp > 1 else None,
            global_tokens=global_tokens,
        )
        return pipeline, _optimizer_fn(pipeline.stage_module)
    model = transformers.LlamaForCausalLM(config)
    if "dp4" in variant:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, process_group=mesh.get_group("dp"), bucket_cap_mb=25, gradient_as_bucket_view=True
        )
        if variant.endswith("+compile"):
            wrapped = torch.compile(wrapped)
        if global_tokens:
            return TokenNormalized(wrapped, mesh.get_group("dp"), 4), _optimizer_fn(model)
        return wrapped, _optimizer_fn(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    _torchtitan_tensor_parallel(model, mesh["tp"])
    layers = model.model.layers
    if variant.endswith("+compile"):
        for index, layer in enumerate(layers):
            layers.register_module(str(index), torch.compile(layer))
    for index, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    if global_tokens:
        # torchtitan turns FSDP2's division off instead (set_gradient_divide_factor(1.0)), which
        # gloo cannot run (a PREMUL_SUM reduce-scatter): the loss times dp, as under DDP.
        return TokenNormalized(model, mesh.get_group("dp"), 2), _optimizer_fn(model)
    return model, _optimizer_fn(model)


def _vescale(
    config: transformers.LlamaConfig, constraints: dict, compile_model: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    vescale.manual_seed(0)
    model = vescale.deferred_init(transformers.LlamaForCausalLM, config)
    plan = vescale.generate_plan(model, constraints)
    model, optimizer, _, _ = vescale.parallelize(plan, model, _optimizer_fn, compile=compile_model)
    return model, optimizer


def _build(
    variant: str, config: transformers.LlamaConfig, batch: int, native_loss: str
) -> tuple[torch.nn.Module | NativePipeline | TokenNormalized, torch.optim.Optimizer]:
    if variant.startswith("native"):
        return _native(variant, config, batch, native_loss)
    dp, stages = _data_parallel(variant), _pipeline_stages(variant)
    if stages > 1:  # the pipeline: one-row micro-batches, PyTorch's 1F1B, the native side's cuts
        constraints = {
            "pipeline_parallel.size": stages,
            "data_parallel.size": dp,
            "tensor_parallel.size": 1,
            "zero.stage": 0,
            "pipeline_parallel.schedule": "1f1b",
            "pipeline_parallel.num_microbatches": batch,
            "pipeline_parallel.split_method": "manual",
            "pipeline_parallel.split_points": [
                f"model.layers.{cut}" for cut in _cuts(config.num_hidden_layers, stages)
            ],
            "global_batch_size": dp * batch,
        }
        return _vescale(config, constraints, compile_model=False)
    constraints = {"data_parallel.size": 4, "zero.stage": 0}
    if dp == 2:
        constraints = {"data_parallel.size": 2, "tensor_parallel.size": 2, "zero.stage": 3}
        constraints["sequence_parallel"] = False  # the native set-up has none
        constraints["activation_checkpointing"] = RECOMPUTED.get(variant, "none")
    constraints.update({"global_batch_size": dp * batch, "micro_batch_size": batch})
    return _vescale(config, constraints, compile_model="+compile" in variant)


def _steps(model, optimizer, input_ids: torch.Tensor, count: int) -> list[float]:
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        if isinstance(model, NativePipeline):
            model.step(input_ids)  # the schedule runs forward and backward
        elif isinstance(model, TokenNormalized):
            model.loss(input_ids).backward()
        else:
            model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times


def pair_on_ranks(
    ours: str,
    native: str,
    hidden: int,
    layers: int,
    batch: int,
    seq: int,
    warmup: int,
    steps: int,
    blocks: int,
    native_loss: str,
) -> dict:
    """Both sides built in these ranks (native first), then ``blocks`` alternating blocks of ``steps``.

    Returns the slowest rank's per-block median step times.
    """
    torch._dynamo.config.recompile_limit = 64  # both sides' blocks share one code object
    config = _config(hidden, layers, "sdpa" if _sdpa(ours) else "eager")
    # Each dp rank's own rows (the tp ranks and pipeline stages of one dp rank share them).
    generator = torch.Generator().manual_seed(_data_parallel_rank(ours))
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    sides = {}
    for variant in (native, ours):
        model, optimizer = _build(variant, config, batch, native_loss)
        _steps(model, optimizer, input_ids, warmup)
        sides[variant] = (model, optimizer)
    block_times: dict[str, list[float]] = {native: [], ours: []}
    for _ in range(blocks):
        for variant in (native, ours):
            block_times[variant].append(statistics.median(_steps(*sides[variant], input_ids, steps)))
    worst = torch.tensor([*block_times[native], *block_times[ours]], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    values = worst.tolist()
    return {"native": values[:blocks], "ours": values[blocks:]}


def _warm_up_side(
    variant: str, attention: str, batch: int, input_ids: torch.Tensor, native_loss: str
) -> None:
    """Build ``variant`` on a 64-wide twin of the model (one layer, a pipeline's one per stage)
    and run a step, then drop it."""
    layers = max(_pipeline_stages(variant), 1)
    model, optimizer = _build(variant, _config(64, layers, attention), batch, native_loss)
    _steps(model, optimizer, input_ids, 1)
    del model, optimizer
    gc.collect()
    # The measured build compiles afresh: after the twin's shapes, dynamo would recompile with
    # dynamic shapes, which neither the timed pair nor a user runs (and inductor fails on here).
    torch._dynamo.reset()


def peak_on_ranks(
    variant: str, hidden: int, layers: int, batch: int, seq: int, warmup: int, native_loss: str
) -> dict[str, int]:
    """In fresh ranks, the worst rank's peak growth over building ``variant`` and ``warmup`` steps
    (its weights, optimizer state, activations and temporaries): of malloc's bytes in use (the
    checked figure) and of the resident set."""
    config = _config(hidden, layers, "sdpa" if _sdpa(variant) else "eager")
    generator = torch.Generator().manual_seed(_data_parallel_rank(variant))
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    _warm_up_side(variant, "sdpa" if _sdpa(variant) else "eager", batch, input_ids, native_loss)
    with PeakResident() as resident, PeakHeapInUse() as heap:
        model, optimizer = _build(variant, config, batch, native_loss)
        _steps(model, optimizer, input_ids, warmup)
    worst = torch.tensor([float(resident.growth), float(heap.growth)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"resident": int(worst[0].item()), "heap": int(worst[1].item())}


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="rows per dp rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per block")
    parser.add_argument("--blocks", type=int, default=5, help="alternating blocks per side")
    parser.add_argument(
        "--pairs", nargs="+", default=[ours for ours, _ in PAIRS], choices=list(OURS_TO_NATIVE)
    )
    parser.add_argument(
        "--native-loss",
        choices=("global-tokens", "rank-mean"),
        default="rank-mean",
        help="the native sides' loss: each rank's own mean, averaged (the default: no collective, not "
        "one device's gradients under padding) or normalized by the global batch's label tokens "
        "(torchtitan's trainer: one all-reduce a step, as veScale's side does the same job)",
    )
    parser.add_argument("--json", help="write the checked rows here (for run_all.py)")
    parser.add_argument(
        "--reuse-ranks",
        action="store_true",
        help="measure memory in the timing ranks, not fresh ones (a smoke run: its peaks mean nothing)",
    )
    args = parser.parse_args()
    from bench_rows import bench_row, write_rows

    shape = (
        args.hidden,
        args.layers,
        args.batch,
        args.seq,
        args.warmup,
        args.steps,
        args.blocks,
        args.native_loss,
    )
    rows = []
    try:
        for ours in args.pairs:
            native = OURS_TO_NATIVE[ours]
            result = run_on_ranks(pair_on_ranks, 4, args=(ours, native, *shape), timeout_s=1800)[0]
            # Each side's memory in fresh rank processes of its own, so neither reuses the other's heap.
            peaks = {}
            for side, variant in (("native", native), ("ours", ours)):
                if not args.reuse_ranks:
                    shutdown_rank_pool()
                memory_shape = (args.hidden, args.layers, args.batch, args.seq, args.warmup, args.native_loss)
                peaks[side] = run_on_ranks(peak_on_ranks, 4, args=(variant, *memory_shape), timeout_s=1800)[0]
            if not args.reuse_ranks:
                shutdown_rank_pool()
            checked = ours not in RECOMPUTED
            rows.append(
                bench_row(
                    "e2e",
                    f"{ours} vs {native}",
                    result["ours"],
                    result["native"],
                    peaks["ours"]["heap"],
                    peaks["native"]["heap"],
                    time_goal=1.0 if checked else None,
                    memory_goal=1.0 if checked else None,
                    resident_peaks=(peaks["ours"]["resident"], peaks["native"]["resident"]),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutdown_rank_pool()
    tokens = f"{args.batch}x{args.seq} tokens per dp rank"
    blocks = f"{args.blocks} blocks of {args.steps} steps"
    print(
        f"\nLlama hidden={args.hidden} layers={args.layers}, {tokens}, {blocks}, "
        f"native loss: {args.native_loss}"
    )
    print(
        "| ours vs native | ours ms | native ms | time ratio, median (min-max) | "
        "peak heap in use MiB, ours / native (ratio) | peak resident ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['row']} | {row['ours_s'] * 1e3:.1f} | {row['native_s'] * 1e3:.1f} | "
            f"{row['ratio']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) | "
            f"{row['ours_peak'] / MiB:.1f} / {row['native_peak'] / MiB:.1f} ({row['memory_ratio']:.3f}) | "
            f"{row['resident_ratio']:.3f} |"
        )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
