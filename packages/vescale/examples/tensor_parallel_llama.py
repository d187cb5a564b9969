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

from vescale.dmodule import deferred_init, parallelize_module, plan_tensor_parallel
from vescale.dtensor import init_mesh, manual_seed


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_mesh(tp=dist.get_world_size())
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
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
