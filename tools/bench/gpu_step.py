"""Single-accelerator step: vescale vs native PyTorch on a ~1B Llama in bf16 (tokens/s, MFU, memory).

    python tools/bench/gpu_step.py                        # CUDA/NCCL, ~1.1B Llama, 4 x 2048 tokens
    python tools/bench/gpu_step.py --hidden 256 --layers 2 --vocab 512 --seq 64 --batch 2   # a CPU smoke run

One process, world size 1 (NCCL on CUDA, gloo on CPU). The model is ``transformers``'
``LlamaForCausalLM`` from a config (``--hidden`` 2048, ``--layers`` 16, 32 heads, 8 KV heads,
SwiGLU 8192, vocabulary 32000, sdpa attention), built on the device from seed 0, trained
with ``torch.optim.AdamW`` (its defaults) on the same fixed batch. Pairs, each side built beside
the other, then timed in alternating blocks (A B A B ..., ``--blocks`` blocks of ``--steps``
steps, after ``--warmup`` warm-up steps per side, compilation included there):

* ``e2e eager``: bf16 mixed precision (fp32 masters, bf16 compute, fp32 gradients) as
  torchtitan runs it on one GPU, FSDP2 ``fully_shard`` with a ``MixedPrecisionPolicy`` per
  layer and the root, vs ``vescale.parallelize(generate_plan(model, dp=1, mixed_precision=bf16))``;
* ``e2e compile``: the same with each layer ``torch.compile``d vs ``parallelize(compile=True)``;
* ``DDP`` (bf16 weights, gradients and AdamW): ``DistributedDataParallel(gradient_as_bucket_view=True,
  static_graph=True)`` vs ``vescale.doptim.data_parallel(zero_stage=0, grad_dtype=bf16)`` with
  the same 25 MB buckets and ``DistributedOptimizer(master_dtype=None)``;
* ``ZeRO-3`` (bf16): FSDP2 ``fully_shard`` per decoder layer and the root vs
  ``vescale.doptim.data_parallel(zero_stage=3)`` (which is FSDP2 itself underneath).

Step time is zero_grad + forward + backward + optimizer step, synchronised; tokens/s and MFU
(model FLOPs: 6 x parameters x tokens + 12 x layers x hidden x seq^2 x batch for attention,
over ``--peak-tflops``, 989 for an H100/H200's dense bf16) from the median step; memory is the
side's peak allocated bytes during its blocks (both sides' weights are resident, so the
table also gives each side's own resident bytes after its first step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import transformers

PAIRS = ("e2e eager", "e2e compile", "DDP", "ZeRO-3")


def _config(args: argparse.Namespace) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 4),
        max_position_embeddings=max(args.seq, 256),
        attn_implementation="sdpa",
    )


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


def _plain(config: transformers.LlamaConfig, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _device():
            return transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)


def _native(pair: str, config: transformers.LlamaConfig, bucket_mb: float):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if pair.startswith("e2e"):
        # Mixed precision as torchtitan trains on one GPU: FSDP2 keeps fp32 parameters (the
        # masters) and computes in bf16, gradients reduced in fp32; blocks compiled one by one.
        model = _plain(config, torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layers = model.model.layers
        for index, layer in enumerate(layers):
            if pair == "e2e compile":
                layer = torch.compile(layer)
                layers.register_module(str(index), layer)
            fully_shard(layer, mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mp_policy=policy, reshard_after_forward=False)
        return model, _optimizer(model)
    model = _plain(config, torch.bfloat16)
    if pair == "DDP":
        model = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, static_graph=True
        )
    elif pair == "ZeRO-3":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, _optimizer(model)


def _vescale(pair: str, config: transformers.LlamaConfig, bucket_mb: float, batch: int):
    import vescale
    from vescale.doptim import DistributedOptimizer, data_parallel
    from vescale.dtensor import init_mesh

    if pair.startswith("e2e"):
        # vescale's own mixed precision: bf16 parameters and compute, fp32 gradient buckets and
        # fp32 master weights in the optimizer. The model is built on the device (a deferred
        # model without tensor parallelism is materialised on the CPU by vescale.parallelize).
        model = _plain(config, torch.float32)
        constraints = {
            "data_parallel.size": 1,
            "zero.stage": 0,
            "mixed_precision": "bf16",
            "global_batch_size": batch,
            "micro_batch_size": batch,
        }
        plan = vescale.generate_plan(model, constraints)
        model, optimizer, _, _ = vescale.parallelize(plan, model, _optimizer, compile=pair == "e2e compile")
        return model, optimizer
    model = _plain(config, torch.bfloat16)
    if pair == "ZeRO-3":
        data_parallel(model, init_mesh(dp=1), zero_stage=3)
        return model, DistributedOptimizer(_optimizer(model))
    # Like DDP's: bf16 gradients reduced in bf16 straight in the buckets, AdamW on the bf16 weights.
    data_parallel(model, init_mesh(dp=1), zero_stage=0, bucket_size_mb=bucket_mb, grad_dtype=torch.bfloat16)
    return model, DistributedOptimizer(_optimizer(model), master_dtype=None)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(model, optimizer, input_ids: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    optimizer.step()


def _timed_block(model, optimizer, input_ids: torch.Tensor, steps: int) -> tuple[list[float], int]:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        _synchronize()
        start = time.perf_counter()
        _step(model, optimizer, input_ids)
        _synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return times, peak


def run_pair(pair: str, args: argparse.Namespace) -> dict:
    config = _config(args)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=generator).to(_device())
    sides = {}
    for side in ("native", "vescale"):
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        if side == "native":
            model, optimizer = _native(pair, config, args.bucket_mb)
        else:
            model, optimizer = _vescale(pair, config, args.bucket_mb, args.batch)
        for _ in range(args.warmup):
            _step(model, optimizer, input_ids)
        _synchronize()
        resident = (torch.cuda.memory_allocated() if torch.cuda.is_available() else 0) - before
        sides[side] = {"model": model, "optimizer": optimizer, "times": [], "peak": 0, "resident": resident}
    for _ in range(args.blocks):
        for side in ("native", "vescale"):
            entry = sides[side]
            times, peak = _timed_block(entry["model"], entry["optimizer"], input_ids, args.steps)
            entry["times"].append(statistics.median(times))
            entry["peak"] = max(entry["peak"], peak)
    if args.profile:
        _print_profiles(pair, sides, input_ids)
    numel = sum(param.numel() for param in _plain_count(config))
    flops = 6 * numel * args.batch * args.seq + 12 * args.layers * args.hidden * args.seq**2 * args.batch
    result = {"pair": pair, "parameters": numel}
    for side, entry in sides.items():
        median = statistics.median(entry["times"])
        result[side] = {
            "block_medians_s": entry["times"],
            "median_s": median,
            "tokens_per_s": args.batch * args.seq / median,
            "mfu": flops / median / (args.peak_tflops * 1e12),
            "peak_bytes": entry["peak"],
            "resident_bytes": entry["resident"],
        }
    pairs_of_blocks = zip(
        result["vescale"]["block_medians_s"], result["native"]["block_medians_s"], strict=True
    )
    ratios = [ours / native for ours, native in pairs_of_blocks]
    result["ratio_median"] = statistics.median(ratios)
    result["ratio_min_max"] = (min(ratios), max(ratios))
    del sides
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _print_profiles(pair: str, sides: dict, input_ids: torch.Tensor) -> None:
    """``torch.profiler``'s busiest operators (self device time, then self CPU time) of one step per side."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    for side, entry in sides.items():
        _synchronize()
        with profile(activities=activities) as profiler:
            _step(entry["model"], entry["optimizer"], input_ids)
            _synchronize()
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=14, max_name_column_width=60)
        print(f"\n#### profile: {pair}, {side}\n\n{table}", flush=True)


def _plain_count(config: transformers.LlamaConfig):
    with torch.device("meta"):
        return list(transformers.LlamaForCausalLM(config).parameters())


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--profile", action="store_true", help="print each side's torch.profiler table")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    store = tempfile.mkdtemp()
    dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU x{os.cpu_count()}"
    print(f"torch {torch.__version__}, {device}, {backend}; bf16 Llama {vars(args)}", flush=True)
    results = []
    try:
        for pair in args.pairs:
            try:
                results.append(run_pair(pair, args))
            except Exception as error:  # a pair that fails is reported, the others still run
                results.append({"pair": pair, "error": f"{type(error).__name__}: {error}"})
            print(json.dumps(results[-1]), flush=True)
    finally:
        dist.destroy_process_group()
    print(
        "\n| pair | native ms | vescale ms | ratio (min-max) | tokens/s native / vescale | "
        "MFU native / vescale | peak GiB native / vescale |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        if "error" in row:
            print(f"| {row['pair']} | error: {row['error'][:120]} |||||")
            continue
        native, ours = row["native"], row["vescale"]
        low, high = row["ratio_min_max"]
        print(
            f"| {row['pair']} | {native['median_s'] * 1e3:.1f} | {ours['median_s'] * 1e3:.1f} | "
            f"{row['ratio_median']:.3f} ({low:.3f}-{high:.3f}) | "
            f"{native['tokens_per_s']:,.0f} / {ours['tokens_per_s']:,.0f} | "
            f"{native['mfu']:.1%} / {ours['mfu']:.1%} | "
            f"{native['peak_bytes'] / 2**30:.1f} / {ours['peak_bytes'] / 2**30:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
