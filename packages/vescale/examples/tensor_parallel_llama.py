"""Tensor + sequence parallelism of an unmodified Hugging Face Llama, planned automatically.

    .venv/bin/torchrun --nproc-per-node 2 packages/vescale/examples/tensor_parallel_llama.py

Every rank builds the model without allocating it, derives the plan from the model's own
dataflow, materialises only its shards (bitwise the weights one process would build), and
trains with a plain loop. Rank 0 prints the plan's reasons and the losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

from vescale.cli.models import resolve_model
from vescale.dmodule import deferred_init, parallelize_module, plan_tensor_parallel
from vescale.dtensor import init_mesh, manual_seed


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_mesh(tp=dist.get_world_size())
    config = resolve_model("tiny-llama").config  # the `vescale train` default: a 4-layer LlamaConfig
    manual_seed(0)  # the same random numbers on every rank as in one process
    model = deferred_init(transformers.LlamaForCausalLM, config)
    result = plan_tensor_parallel(model, sequence_parallel=True)
    result.check_tp_size(mesh.size())
    parallelize_module(model, mesh, result.plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, config.vocab_size, (4, 32), generator=generator)
    if dist.get_rank() == 0:
        print(result.explain())
    for step in range(10):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
