"""veScale on an accelerator mesh (CUDA/NCCL): the checks CI's CPU machines cannot run.

    torchrun --nproc-per-node <GPUs> tools/cuda_check.py        # one rank per GPU (1 works too)
    torchrun --nproc-per-node 2 tools/cuda_check.py --backend gloo    # 2 ranks sharing one GPU

Each rank builds a tiny ``transformers`` Llama twice: the reference eagerly on its GPU (the
same seed, so the same weights), and veScale's with ``deferred_init``, tensor parallel over
every rank with the automatic plan, materialised on the mesh's device. It then compares, on
the accelerator: the deferred weights (bitwise), one training step's loss and gradients (GUIDE's
relative error), a ZeRO-1 SGD step of the parallel model against ``torch.optim.SGD`` on the
reference, a ``vescale.dcheckpoint`` save/load round trip (bitwise), and dropout on a sharded
activation (runs, the right shape and keep rate). Rank 0 prints one line per check.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import transformers

from vescale.dcheckpoint import load, save
from vescale.dmodule import auto_sharding_plan, deferred_init, parallelize_module
from vescale.doptim import DistributedOptimizer, data_parallel
from vescale.dtensor import Replicate, Shard, distribute_tensor, init_mesh, manual_seed
from vescale.dtensor.testing.models.tiny_hf import tiny_hf_config
from vescale.dtensor.testing.numerics import full_value, gradient_errors, relative_error

# The test kit's tiny Llama: 8 query and 4 key/value heads, so up to 4 tensor-parallel ranks.
CONFIG = tiny_hf_config("llama")


def report(name: str, ok: bool, detail: str) -> bool:
    if dist.get_rank() == 0:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        default="nccl" if torch.cuda.is_available() else "gloo",
        help="gloo lets several ranks share one GPU (NCCL needs one GPU per rank)",
    )
    arguments = parser.parse_args()
    dist.init_process_group(arguments.backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mesh = init_mesh(
        device_type="cuda" if torch.cuda.is_available() else "cpu", dp=1, tp=dist.get_world_size()
    )
    device = torch.device(mesh.device_type, torch.cuda.current_device() if torch.cuda.is_available() else 0)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    results = [
        report(
            "mesh",
            mesh.device_type == expected,
            f"device type {mesh.device_type!r}, backend {dist.get_backend()}",
        )
    ]

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(CONFIG).to(device)
    manual_seed(0)
    model = deferred_init(transformers.LlamaForCausalLM, CONFIG)
    parallelize_module(model, mesh, auto_sharding_plan(model))
    worst = max(
        relative_error(full_value(p).to(device), r)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    devices = {full_value(p).device.type for p in model.parameters()}
    results.append(
        report(
            "deferred init",
            worst == 0.0 and devices == {device.type},
            f"max weight error {worst}, on {devices}",
        )
    )

    batch = torch.randint(0, CONFIG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    reference_loss = reference(input_ids=batch, labels=batch).loss
    reference_loss.backward()
    data_parallel(model, mesh, zero_stage=1)
    # SGD: linear in the gradient, so the step inherits the gradients' tiny error (a first AdamW
    # step would turn ulp-level noise of near-zero gradients into whole learning-rate steps).
    optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    loss_error = relative_error(full_value(loss), reference_loss.detach())
    grad_error = max(gradient_errors(model, reference).values())
    results.append(
        report(
            "train step",
            loss_error <= 1e-5 and grad_error <= 1e-4,
            f"loss error {loss_error:.1e}, max grad error {grad_error:.1e}",
        )
    )
    optimizer.step()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_optimizer.step()
    step_error = max(
        relative_error(full_value(p).to(device), r.detach())
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    results.append(report("ZeRO-1 SGD step", step_error <= 1e-5, f"max parameter error {step_error:.1e}"))

    directory = tempfile.mkdtemp() if dist.get_rank() == 0 else None
    shared = [directory]
    dist.broadcast_object_list(shared, src=0)
    save(os.path.join(shared[0], "ckpt"), {"model": model})
    manual_seed(1)  # other initial weights, which the load must overwrite
    restored = deferred_init(transformers.LlamaForCausalLM, CONFIG)
    parallelize_module(restored, mesh, auto_sharding_plan(restored))
    load(os.path.join(shared[0], "ckpt"), {"model": restored})
    same = all(
        torch.equal(full_value(a), full_value(b))
        for a, b in zip(model.parameters(), restored.parameters(), strict=True)
    )
    results.append(report("checkpoint round trip", same, "bitwise" if same else "differs"))

    hidden = distribute_tensor(torch.randn(4, 32, 64, device=device), mesh, [Replicate(), Shard(1)])
    dropped = torch.nn.functional.dropout(hidden, p=0.5)
    kept = (full_value(dropped) != 0).float().mean().item()
    results.append(
        report(
            "dropout on a DTensor",
            abs(kept - 0.5) < 0.05,
            f"keep rate {kept:.3f}, placements {dropped.placements}",
        )
    )
    dist.destroy_process_group()
    if not all(results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
