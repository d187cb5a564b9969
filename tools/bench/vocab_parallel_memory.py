"""Memory of vocabulary-parallel logits and loss vs gathering the logits, per rank.

An LM head (``Linear(hidden, vocab)``) and cross-entropy, parallelized with
``vescale.dmodule.parallelize_module`` on ``--tp`` gloo ranks in two ways, from the same
weights and batch:

* vocab-parallel: the head's weight ``S(0)`` and its output ``S(-1)``; the loss runs on the
  vocabulary shards (each rank holds tokens x vocab/tp logits, nothing gathers them);
* gathered: the same weight, but the head's output is made ``R`` (all-gathered), as a plan
  without a sharded loss must do: every rank holds the full tokens x vocab logits.

For each, one forward + backward of the loss is measured as the peak resident-set delta over
the rank's baseline after set-up and a warm-up step (``vescale.dtensor.testing.memory``), next
to the logits' own size; the single-process head is measured the same way. Both losses are
checked against the single-process loss (relative error), so the saving is for equal work.

    .venv/bin/python tools/bench/vocab_parallel_memory.py                  # TP=4, 32k vocab
    .venv/bin/python tools/bench/vocab_parallel_memory.py --tp 2 --vocab 16384
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.memory import PeakResident

MIB = 2**20


class LMHeadLoss(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


PLANS = {
    "vocab-parallel": {
        "parameter": {r"lm_head\.weight": "S(0)"},
        "forward": {"lm_head.input": ["R"], "lm_head.output": ["S(-1)"]},
    },
    "gathered": {
        "parameter": {r"lm_head\.weight": "S(0)"},
        "forward": {"lm_head.input": ["R"], "lm_head.output": ["R"]},
    },
}


def peak_delta(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(peak resident delta in bytes, loss) of one forward + backward, after a warm-up step."""
    model(hidden, labels).backward()
    model.zero_grad(set_to_none=True)
    with PeakResident() as peak:
        loss = model(hidden, labels)
        loss.backward()
    value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
    model.zero_grad(set_to_none=True)
    return peak.growth, value


def measure_on_rank(tokens: tuple[int, int], hidden_size: int, vocab: int) -> dict:
    from vescale.dmodule import parallelize_module
    from vescale.dtensor import init_mesh

    torch.manual_seed(0)
    reference = LMHeadLoss(hidden_size, vocab)
    hidden = torch.randn(*tokens, hidden_size)
    labels = torch.randint(0, vocab, tokens)
    mesh = init_mesh(tp=torch.distributed.get_world_size())
    results = {}
    for name, plan in PLANS.items():
        model = parallelize_module(copy.deepcopy(reference), mesh, plan)
        results[name] = peak_delta(model, hidden, labels)
        del model
    results["single process"] = peak_delta(reference, hidden, labels)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    tokens = args.batch * args.seq
    per_rank = run_on_ranks(
        measure_on_rank, world_size=args.tp, args=((args.batch, args.seq), args.hidden, args.vocab)
    )
    shutdown_rank_pool()
    reference_loss = per_rank[0]["single process"][1]
    logits_mib = {
        "vocab-parallel": tokens * args.vocab // args.tp * 4 / MIB,
        "gathered": tokens * args.vocab * 4 / MIB,
        "single process": tokens * args.vocab * 4 / MIB,
    }
    print(
        f"torch {torch.__version__}, TP={args.tp} gloo ranks; {tokens} tokens x vocab {args.vocab}, "
        f"hidden {args.hidden}, fp32; peak resident delta of one forward+backward, worst rank\n"
    )
    print("| variant | logits per rank MiB | peak delta MiB | vs single process | loss rel err |")
    print("|---|---|---|---|---|")
    single_peak = max(rank["single process"][0] for rank in per_rank)
    for name in ("vocab-parallel", "gathered", "single process"):
        peak = max(rank[name][0] for rank in per_rank)
        loss = per_rank[0][name][1]
        error = abs(loss - reference_loss) / abs(reference_loss)
        print(
            f"| {name} | {logits_mib[name]:.1f} | {peak / MIB:.1f} | {peak / single_peak:.2f} | {error:.1e} |"
        )
    worst = {name: max(rank[name][0] for rank in per_rank) for name in PLANS}
    saved = worst["gathered"] - worst["vocab-parallel"]
    print(f"\nlogits memory saved per rank by the vocabulary-parallel loss: {saved / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
