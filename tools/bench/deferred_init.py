"""Deferred initialisation of a Llama-shaped model with TP=4-like placements: memory and time.

Each of ``--ranks`` gloo processes (one thread each) builds the model with
``vescale.dmodule.deferred_init`` and materialises only its shards (q/k/v/gate/up and the
embedding and head by rows, o/down by columns, norms replicated). A separate process builds
the same model eagerly as the reference. Memory figures are resident-set deltas over each
process's baseline after imports (sampled every millisecond; the peak is the largest sample).

    .venv/bin/python tools/bench/deferred_init.py                  # ~1.35B parameters, 4 ranks
    .venv/bin/python tools/bench/deferred_init.py --layers 2       # quick check
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vescale.dtensor.testing.memory import PeakResident, resident_bytes

GIB = 2**30


def llama_config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=16,
    )


def import_everything() -> None:
    """Build a tiny model both ways, so that the baseline includes every lazily imported module."""
    import transformers

    import vescale.dmodule

    tiny = transformers.LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(tiny)
    vescale.dmodule.materialize_module(vescale.dmodule.deferred_init(transformers.LlamaForCausalLM, tiny))


def measurement_start(args: argparse.Namespace) -> tuple[object, int]:
    """The config and the resident baseline both paths measure from: taken after every import, so
    that only the model counts, then the weights' seed."""
    config = llama_config(args)
    import_everything()
    baseline = resident_bytes()
    torch.manual_seed(0)
    return config, baseline


def tp_placements(fqn: str, mesh):
    from torch.distributed.tensor import Replicate, Shard

    column_parallel = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    if fqn.endswith(tuple(f"{name}.weight" for name in column_parallel)):
        return mesh, [Shard(0)]
    if fqn.endswith(("o_proj.weight", "down_proj.weight")):
        return mesh, [Shard(1)]
    if fqn in ("model.embed_tokens.weight", "lm_head.weight"):
        return mesh, [Shard(0)]
    return mesh, [Replicate()]


def deferred_rank(rank: int, world_size: int, store_path: str, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import vescale.dmodule

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    config, baseline = measurement_start(args)
    with PeakResident() as peak:
        start = time.perf_counter()
        model = vescale.dmodule.deferred_init(transformers.LlamaForCausalLM, config)
        recorded = time.perf_counter()
        vescale.dmodule.materialize_module(model, lambda fqn: tp_placements(fqn, mesh))
        done = time.perf_counter()
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    dist.barrier()
    results.put((rank, recorded - start, done - recorded, peak.peak - baseline, local_bytes, largest))
    dist.destroy_process_group()


def eager_process(args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    import transformers

    config, baseline = measurement_start(args)
    with PeakResident() as peak:
        start = time.perf_counter()
        model = transformers.LlamaForCausalLM(config)
        elapsed = time.perf_counter() - start
    results.put((elapsed, peak.peak - baseline, sum(p.numel() for p in model.parameters())))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: ~1.35B parameters)")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    context = mp.get_context("spawn")

    results = context.Queue()
    eager = context.Process(target=eager_process, args=(args, results))
    eager.start()
    eager_seconds, eager_peak, parameter_count = results.get()
    eager.join()

    with tempfile.TemporaryDirectory() as directory:
        store_path = os.path.join(directory, "store")
        ranks = [
            context.Process(target=deferred_rank, args=(rank, args.ranks, store_path, args, results))
            for rank in range(args.ranks)
        ]
        for process in ranks:
            process.start()
        per_rank = sorted(results.get() for _ in ranks)
        for process in ranks:
            process.join()

    model_bytes = parameter_count * 4
    largest = per_rank[0][5]
    goal = (model_bytes / args.ranks + largest) * 1.1
    print(f"Llama-shaped model: {parameter_count / 1e9:.3f}B parameters, fp32 {model_bytes / GIB:.2f} GiB,")
    print(f"largest parameter {largest / GIB:.3f} GiB; {args.ranks} gloo ranks, one thread per process")
    print(f"goal per rank: (model/{args.ranks} + largest) * 1.1 = {goal / GIB:.2f} GiB\n")
    header = "| process | record s | materialise s | total s | peak RSS Δ GiB | shards GiB | peak/goal |"
    print(header)
    print("|---|---|---|---|---|---|---|")
    print(f"| eager (1 process) | - | - | {eager_seconds:.1f} | {eager_peak / GIB:.2f} | - | - |")
    for rank, record_s, materialise_s, peak, local, _ in per_rank:
        print(
            f"| rank {rank} | {record_s:.1f} | {materialise_s:.1f} | {record_s + materialise_s:.1f} | "
            f"{peak / GIB:.2f} | {local / GIB:.2f} | {peak / goal:.2f} |"
        )


if __name__ == "__main__":
    main()
