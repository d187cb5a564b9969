"""Tensor-parallel training step: veScale's DModule vs PyTorch-native ``parallelize_module``.

    .venv/bin/python tools/bench/tp_step.py                 # TP=4 on 4 gloo ranks, SP off and on
    .venv/bin/python tools/bench/tp_step.py --tp 2 4        # also TP=2 (on 2 ranks)
    .venv/bin/python tools/bench/tp_step.py --profile       # cProfile of rank 0's veScale steps

The model is a small Llama-shaped decoder written here (embedding, blocks of RMSNorm +
attention with separate q/k/v/o + RMSNorm + SwiGLU gate/up/down, final norm, LM head,
cross-entropy), written so that native ``parallelize_module`` runs it: heads come from the
local shard (``view(b, s, -1, head_dim)``). Both variants start from the same weights
(seeded construction, then a deep copy) and train on the same fixed batch with AdamW:

* native: ``torch.distributed.tensor.parallel.parallelize_module`` with the hand-written
  torchtitan-style plan below, vocabulary-parallel embedding and LM head, the loss under
  ``loss_parallel`` (so neither side gathers the logits);
* veScale: ``vescale.dmodule.parallelize_module`` with
  ``vescale.dmodule.auto_sharding_plan(model, sequence_parallel=...)``.

Step time is fwd + bwd + AdamW step, the two variants alternating step by step (so that
machine noise hits both alike), each step bracketed by barriers: the slowest rank's time.
The median of ``--steps`` steps after ``--warmup`` is reported. Every rank runs one thread.

Memory is the worst rank's peak growth of malloc's bytes in use during one extra step of each
variant (:class:`~vescale.dtensor.testing.memory.PeakHeapInUse`, the checked figure; the resident
set's beside it), over what was in use just before that step with the variant's gradients
dropped (both models live in the same process, so weights and optimizer state are left out;
what remains is the step's gradients, activations and temporaries).

Communication is counted with :class:`vescale.dtensor.comm.CommCounter` over one extra step.
Calls are attributed to parts of the model by order of issue: forward hooks on the embedding,
each block, the final norm and the LM head note the counter's position before and after each
part; in backward, tensor hooks on each part's output note the position when the gradient
reaches it (backward runs the parts in reverse, so the calls between two marks belong to
the part in between). Forward calls after the LM head, and backward calls before the logits'
gradient, are the loss's. Backward calls after the embedding output's gradient and calls after
``backward()`` returned are gradient sync (veScale reduces Partial parameter gradients at the
end of backward) unless their size is that of the embedding's activations, which makes them
the embedding's backward. The blocks' bytes are compared with the Megatron formula.
"""

from __future__ import annotations

import copy
import cProfile
import dataclasses
import io
import math
import os
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.memory import PeakHeapInUse, PeakResident


@dataclasses.dataclass(frozen=True)
class ModelSize:
    vocab: int = 1024
    hidden: int = 256
    heads: int = 8
    ffn: int = 512
    layers: int = 4
    batch: int = 2
    seq: int = 64


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.head_dim = size.hidden // size.heads
        self.q = nn.Linear(size.hidden, size.hidden, bias=False)
        self.k = nn.Linear(size.hidden, size.hidden, bias=False)
        self.v = nn.Linear(size.hidden, size.hidden, bias=False)
        self.o = nn.Linear(size.hidden, size.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]
        # -1 heads: under native TP each rank's projections hold only its heads.
        q = self.q(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.gate = nn.Linear(size.hidden, size.ffn, bias=False)
        self.up = nn.Linear(size.hidden, size.ffn, bias=False)
        self.down = nn.Linear(size.ffn, size.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(size.hidden)
        self.attention = Attention(size)
        self.mlp_norm = RMSNorm(size.hidden)
        self.mlp = SwiGLU(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.hidden)
        self.layers = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.norm = RMSNorm(size.hidden)
        self.lm_head = nn.Linear(size.hidden, size.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def native_plan(model: TinyLlama, sequence_parallel: bool) -> dict:
    """torchtitan's Llama plan, adapted to this model's names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for index in range(len(model.layers)):
        prefix = f"layers.{index}"
        for branch, columns, row in (("attention", "qkv", "o"), ("mlp", ("gate", "up"), "down")):
            plan.update({f"{prefix}.{branch}.{column}": ColwiseParallel() for column in columns})
            plan[f"{prefix}.{branch}.{row}"] = RowwiseParallel(output_layouts=residual)
            if sequence_parallel:
                plan[f"{prefix}.{branch}_norm"] = SequenceParallel()
            # The branch's input becomes one Replicate DTensor that all its column-parallel
            # projections read (use_local_output=False, as torchtitan does): their input
            # gradients add up as one Partial DTensor, reduced once per branch in backward (one
            # reduce-scatter under SP, one all-reduce without), not once per projection.
            plan[f"{prefix}.{branch}"] = PrepareModuleInput(
                input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_output=False
            )
    return plan


def full_value(tensor: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).item()


class StepRunner:
    """One variant's model, optimizer and step function."""

    def __init__(self, model: nn.Module, native: bool) -> None:
        self.model = model
        self.native = native
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.native:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = self.model(batch, batch)
                loss.backward()
            return loss
        loss = self.model(batch, batch)
        loss.backward()
        return loss

    def step(self, batch: torch.Tensor) -> tuple[float, torch.Tensor]:
        dist.barrier()
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(batch)
        self.optimizer.step()
        dist.barrier()
        return time.perf_counter() - started, loss


def attribute_calls(runner: StepRunner, batch: torch.Tensor, mesh, size: ModelSize) -> list[tuple]:
    """``(part, phase, collective, numel, bytes_sent, projection)`` for every collective of one step.

    ``projection`` names the block projection (``q``, ..., ``down``) inside whose forward
    (hooks included) a forward collective ran, else ``""``.
    """
    from vescale.dtensor.comm import CommCounter

    model = runner.model
    parts = [("embedding", model.embed), *((f"block {i}", layer) for i, layer in enumerate(model.layers))]
    parts += [("final norm", model.norm), ("lm head", model.lm_head)]
    forward_marks: list[tuple[str, int, int]] = []
    backward_marks: list[tuple[str, int]] = []
    handles = []
    counter = CommCounter(mesh)

    def on_forward_start(name: str):
        return lambda module, args: forward_marks.append((name, len(counter.calls), -1))

    def on_forward_end(name: str):
        def hook(module, args, output):
            start = forward_marks.pop()[1]
            forward_marks.append((name, start, len(counter.calls)))
            output.register_hook(lambda grad: backward_marks.append((name, len(counter.calls))))

        return hook

    for name, module in parts:
        # prepend: the plan's input redistribution (its own pre-hooks) counts as the part's.
        handles.append(module.register_forward_pre_hook(on_forward_start(name), prepend=True))
        handles.append(module.register_forward_hook(on_forward_end(name)))
    # Each projection's own forward window (its input/output redistribution included), to
    # say which projection a block's forward collective belongs to.
    projection_windows: list[tuple[str, int, int]] = []
    projection_starts: dict[str, int] = {}
    for fqn, module in model.layers.named_modules():
        if isinstance(module, nn.Linear):
            leaf = fqn.rpartition(".")[2]

            def start(module, args, fqn=fqn):
                projection_starts[fqn] = len(counter.calls)

            def end(module, args, output, fqn=fqn, leaf=leaf):
                projection_windows.append((leaf, projection_starts.pop(fqn), len(counter.calls)))

            handles.append(module.register_forward_pre_hook(start, prepend=True))
            handles.append(module.register_forward_hook(end))
    with counter:
        runner.optimizer.zero_grad(set_to_none=True)
        runner.forward_backward(batch)
        after_backward = len(counter.calls)
        runner.optimizer.step()
    for handle in handles:
        handle.remove()
    calls = counter.calls
    part_of: dict[int, str] = {}
    for name, start, end in forward_marks:
        part_of.update({index: name for index in range(start, end)})
    forward_end = max(end for _, _, end in forward_marks)
    part_of.update({index: "loss" for index in range(forward_end) if index not in part_of})
    # backward: the calls after the gradient reached part k's output and before it reached
    # the output of the part before it belong to part k.
    order = [name for name, _ in reversed(parts)]
    reached = dict(backward_marks)
    boundaries = [reached[name] for name in order]
    part_of.update({index: "loss" for index in range(forward_end, boundaries[0])})
    for position, name in enumerate(order):
        start = boundaries[position]
        end = boundaries[position + 1] if position + 1 < len(order) else after_backward
        part_of.update({index: name for index in range(start, end)})
    projection_of = {index: leaf for leaf, start, end in projection_windows for index in range(start, end)}
    activation_numel = size.batch * size.seq * size.hidden
    rows = []
    for call in calls:
        part = part_of.get(call.index, "gradient sync")
        if part == "embedding" and call.index >= boundaries[-1] and call.numel != activation_numel:
            part = "gradient sync"
        if call.index >= after_backward:
            part = "gradient sync"
        projection = projection_of.get(call.index, "")
        rows.append((part, call.phase, call.collective, call.numel, call.bytes_sent, projection))
    return rows


def benchmark_rank(
    sequence_parallel: bool, size_fields: dict, warmup: int, steps: int, profile: bool
) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module as native_parallelize_module

    import vescale.dmodule
    from vescale.dtensor import init_mesh

    size = ModelSize(**size_fields)  # a plain dict pickles; the ranks see this script as another module
    torch.manual_seed(0)
    reference = TinyLlama(size)
    batch = torch.randint(0, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(1))
    mesh = init_mesh(tp=dist.get_world_size())
    native_model = copy.deepcopy(reference)
    native_parallelize_module(native_model, mesh, native_plan(native_model, sequence_parallel))
    vescale_model = copy.deepcopy(reference)
    plan = vescale.dmodule.auto_sharding_plan(vescale_model, sequence_parallel=sequence_parallel)
    vescale.dmodule.parallelize_module(vescale_model, mesh, plan)
    native, ours = StepRunner(native_model, native=True), StepRunner(vescale_model, native=False)
    times: dict[str, list[float]] = {"native": [], "vescale": []}
    losses: dict[str, list[float]] = {"native": [], "vescale": []}
    profiler = cProfile.Profile() if profile and dist.get_rank() == 0 else None
    for step in range(warmup + steps):
        for name, runner in (("native", native), ("vescale", ours)):
            if profiler is not None and name == "vescale" and step >= warmup:
                profiler.enable()
            seconds, loss = runner.step(batch)
            if profiler is not None:
                profiler.disable()
            losses[name].append(full_value(loss))
            if step >= warmup:
                slowest = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times[name].append(slowest.item())
    result = {"times": times, "losses": losses, "memory": step_memory(native, ours, batch)}
    result["comm"] = {
        "vescale": attribute_calls(ours, batch, mesh, size),
        "native": attribute_calls(native, batch, mesh, size),
    }
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        result["profile"] = text.getvalue()
    return result


def step_memory(native: StepRunner, ours: StepRunner, batch: torch.Tensor) -> dict[str, dict[str, int]]:
    """Per variant, the worst rank's peak growth during one training step (bytes): of malloc's
    bytes in use (the checked figure) and of the resident set.

    Both models live in this process, so a step's growth is measured over what each holds with its
    gradients dropped (its weights and Adam state): the step's gradients, activations and
    temporaries. Over what was alive with the previous step's gradients instead, a side whose
    gradients are larger than its parameters (torch's ``RowwiseParallel`` embedding: a Replicate,
    full-size gradient of its ``Shard(0)`` weight, 0.75 MiB more on tp4) would be credited with
    freeing them.
    """
    memory = {}
    for name, runner in (("native", native), ("vescale", ours)):
        runner.optimizer.zero_grad(set_to_none=True)
        with PeakResident() as resident, PeakHeapInUse() as heap:
            runner.step(batch)
        worst = torch.tensor([resident.growth, heap.growth], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        memory[name] = {"resident": int(worst[0].item()), "heap": int(worst[1].item())}
    return memory


def megatron_block_traffic(size: ModelSize, tp: int, sequence_parallel: bool) -> dict[tuple[str, str], tuple]:
    """``{(phase, collective): (count, elements, bytes sent)}`` Megatron's formula gives all blocks."""
    activation = size.batch * size.seq * size.hidden
    element_bytes = 4
    expected = {}
    for phase in ("forward", "backward"):
        if sequence_parallel:
            for collective in ("all_gather", "reduce_scatter"):
                count = 2 * size.layers
                moved = count * (tp - 1) * activation * element_bytes / tp
                expected[(phase, collective)] = (count, count * activation, moved)
        else:
            count = 2 * size.layers
            moved = count * 2 * (tp - 1) * activation * element_bytes / tp
            expected[(phase, "all_reduce")] = (count, count * activation, moved)
    return expected


def summarise(rows: list[tuple], part_filter) -> dict[tuple[str, str], list]:
    totals: dict[tuple[str, str], list] = {}
    for part, phase, collective, numel, sent, _ in rows:
        if part_filter(part):
            entry = totals.setdefault((phase, collective), [0, 0, 0.0])
            entry[0] += 1
            entry[1] += numel
            entry[2] += sent
    return totals


def _in_part(name: str, part: str) -> bool:
    return name == part or (part == "blocks" and name.startswith("block "))


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _mib_pair(memory: dict[str, dict[str, int]], kind: str) -> str:
    return f"{memory['native'][kind] / 2**20:.1f} / {memory['vescale'][kind] / 2**20:.1f}"


def report(tp: int, sequence_parallel: bool, size: ModelSize, result: dict) -> bool:
    """Print the tables of one configuration; return whether the block traffic matches Megatron."""
    label = f"TP={tp}, SP {'on' if sequence_parallel else 'off'}"
    native_ms = statistics.median(result["times"]["native"]) * 1e3
    vescale_ms = statistics.median(result["times"]["vescale"]) * 1e3
    losses, memory = result["losses"], result["memory"]
    first_error = abs(losses["vescale"][0] - losses["native"][0]) / abs(losses["native"][0])
    max_error = max(abs(a - b) / abs(b) for a, b in zip(losses["vescale"], losses["native"], strict=True))
    print(f"\n### {label}\n")
    print(
        markdown_table(
            [
                "native ms",
                "veScale ms",
                "ratio (goal <= 1.00)",
                "step peak heap in use MiB native / veScale",
                "step peak resident MiB native / veScale",
                "step-0 loss rel err",
                "max loss rel err",
            ],
            [
                [
                    f"{native_ms:.1f}",
                    f"{vescale_ms:.1f}",
                    f"{vescale_ms / native_ms:.3f}",
                    _mib_pair(memory, "heap"),
                    _mib_pair(memory, "resident"),
                    f"{first_error:.1e}" + (" ok" if first_error <= 1e-5 else " FAIL"),
                    f"{max_error:.1e}",
                ]
            ],
        )
    )
    expected = megatron_block_traffic(size, tp, sequence_parallel)
    measured = summarise(result["comm"]["vescale"], lambda part: part.startswith("block"))
    keys = sorted(set(expected) | set(measured))
    rows, agree = [], True
    for key in keys:
        want = expected.get(key, (0, 0, 0.0))
        got = tuple(measured.get(key, (0, 0, 0.0)))
        match = want[:2] == got[:2] and math.isclose(want[2], got[2], rel_tol=0, abs_tol=1e-6)
        agree &= match
        rows.append(
            [
                *key,
                f"{got[0]} / {want[0]}",
                f"{got[1]:,} / {want[1]:,}",
                f"{got[2]:,.0f} / {want[2]:,.0f}",
                "yes" if match else "NO",
            ]
        )
    print(f"\nBlocks' collectives per step, veScale (measured / Megatron formula), {size.layers} layers:\n")
    print(markdown_table(["phase", "collective", "calls", "elements", "bytes sent per rank", "agree"], rows))
    if not agree:
        per_projection: dict[tuple[str, str], int] = {}
        for part, phase, collective, _, _, projection in result["comm"]["vescale"]:
            if part.startswith("block ") and phase == "forward":
                key = (projection or "(between projections)", collective)
                per_projection[key] = per_projection.get(key, 0) + 1
        where = ", ".join(
            f"{name} {coll} x{count // size.layers}" for (name, coll), count in per_projection.items()
        )
        print(
            "\nDifference: forward collectives per layer, by the projection whose hooks issued them: "
            f"{where}."
        )
    print("\nAll collectives per step by part (calls, bytes sent per rank):\n")
    part_rows = []
    for part in ("embedding", "blocks", "final norm", "lm head", "loss", "gradient sync"):
        cells = [part]
        for variant in ("vescale", "native"):
            totals = summarise(result["comm"][variant], lambda name, part=part: _in_part(name, part))
            described = ", ".join(
                f"{phase[:3]} {collective} x{count} {sent:,.0f} B"
                for (phase, collective), (count, _, sent) in sorted(totals.items())
            )
            cells.append(described or "-")
        part_rows.append(cells)
    print(markdown_table(["part", "veScale", "native"], part_rows))
    return agree


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument(
        "--tp", type=int, nargs="+", default=[4, 2], help="TP sizes (each on that many ranks)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--profile", action="store_true", help="print cProfile of rank 0's veScale steps")
    parser.add_argument("--json", help="write the checked rows here (for run_all.py)")
    arguments = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    size = ModelSize(layers=arguments.layers)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo; model {size}; "
        f"median of {arguments.steps} steps after {arguments.warmup} warm-up, slowest rank per step"
    )
    all_agree = True
    rows = []
    for tp in arguments.tp:
        for sequence_parallel in (False, True):
            result = run_on_ranks(
                benchmark_rank,
                tp,
                (
                    sequence_parallel,
                    dataclasses.asdict(size),
                    arguments.warmup,
                    arguments.steps,
                    arguments.profile,
                ),
                timeout_s=600,
            )[0]
            all_agree &= report(tp, sequence_parallel, size, result)
            rows.append(
                _bench_row(
                    f"TP={tp} SP {'on' if sequence_parallel else 'off'} vs torchtitan-style plan",
                    result["times"]["vescale"],
                    result["times"]["native"],
                    result["memory"]["vescale"],
                    result["memory"]["native"],
                )
            )
            if arguments.profile:
                print(f"\ncProfile, rank 0, veScale steps:\n\n```\n{result['profile']}\n```")
    shutdown_rank_pool()
    print(f"\nblock traffic agrees with the Megatron formula: {'yes' if all_agree else 'NO'}")
    from bench_rows import write_rows

    write_rows(arguments.json, rows)


def _bench_row(
    name: str, ours: list[float], native: list[float], ours_peak: dict[str, int], native_peak: dict[str, int]
) -> dict:
    from bench_rows import bench_row

    resident = (ours_peak["resident"], native_peak["resident"])
    peaks = (ours_peak["heap"], native_peak["heap"])
    return bench_row("tp_step", name, ours, native, *peaks, resident_peaks=resident)


if __name__ == "__main__":
    main()
