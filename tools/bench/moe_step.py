"""MoE training step on 4 ranks: experts sharded over ep vs replicated (dp) vs split over tp.

    .venv/bin/python tools/bench/moe_step.py                       # Mixtral-style, 8 experts, top-2
    .venv/bin/python tools/bench/moe_step.py --hidden 64 --steps 2  # a quick run

A Mixtral-style ``transformers`` model (``--experts`` experts, top-2, ``--layers`` layers, the
load-balancing loss on) trains with SGD through ``vescale.parallelize`` under three plans on the
same 4 gloo ranks, one thread per rank, from the same seed and global batches:

* ``ep4``: experts sharded over ep (E/4 whole experts per rank, all-to-all dispatch), the batch
  split over the 4 ranks, everything else data parallel over them;
* ``dp4``: experts replicated, plain data parallel (the baseline: what runs without EP);
* ``tp4``: tensor parallelism inside the experts (and the rest), the batch on every rank.

Step time: fwd + bwd + step + zero_grad, bracketed by barriers, the slowest rank, median of
``--steps`` after one warm-up. Memory: ``PeakResident`` growth over the run from before the model
is built (worst rank; an unmeasured ep4 run first pays the imports and process groups) and the
parameter bytes each rank holds.

All-to-all bytes (ep4, one forward): ``measured`` is what ``vescale.dtensor.comm.CommCounter``
records for the dispatch and combine all-to-alls of every MoE block, summed over ranks;
``routed`` is the count from the routing itself: (token, k) pairs whose expert lives on
another rank x hidden x 4 bytes (what the dispatch moves: pairs that stay on their rank are not
sent); ``analytic`` is the issue's formula tokens x top-k x hidden x 4 x (ep-1)/ep per direction
and block, the expectation under uniform routing. ``measured == routed`` exactly; ``analytic``
differs by the router's imbalance (and equals ``measured`` exactly under balanced routing, which
``packages/dmodule/tests/test_dmodule_experts_routing.py`` checks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from vescale.dtensor.testing import run_on_ranks, shutdown_rank_pool
from vescale.dtensor.testing.memory import PeakResident

PLANS = ("ep4", "dp4", "tp4")
WORLD = 4


def _model(arguments: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=arguments.vocab,
        hidden_size=arguments.hidden,
        intermediate_size=arguments.hidden * 2,
        num_hidden_layers=arguments.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=arguments.experts,
        num_experts_per_tok=2,
        max_position_embeddings=arguments.seq,
        output_router_logits=True,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _plan(model: torch.nn.Module, key: str, global_batch: int):
    from vescale.dmodule import plan_tensor_parallel
    from vescale.doptim.plan import DataParallelPlan
    from vescale.planner import Plan

    mesh = {"ep4": {"ep": 4}, "dp4": {"dp": 4}, "tp4": {"tp": 4}}[key]
    batch_ranks = mesh.get("dp", 1) * mesh.get("ep", 1)
    return Plan(
        mesh=mesh,
        data_parallel=DataParallelPlan(size=mesh.get("dp", 1)),
        global_batch_size=global_batch,
        micro_batch_size=global_batch // batch_ranks,
        sharding_plan=plan_tensor_parallel(model).plan if key == "tp4" else None,
    )


def _batch(step: int, arguments: argparse.Namespace) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step + 1)
    return torch.randint(0, arguments.vocab, (arguments.batch, arguments.seq), generator=generator)


def _local_rows(ids: torch.Tensor, mesh, key: str) -> torch.Tensor:
    if key == "tp4":
        return ids
    rows = ids.shape[0] // WORLD
    rank = dist.get_rank()
    return ids[rank * rows : (rank + 1) * rows]


def _all_to_all_bytes(model, arguments: argparse.Namespace) -> dict[str, int]:
    from vescale.dtensor.comm import FORWARD, CommCounter

    routing = []
    hooks = [
        module.register_forward_hook(lambda _m, _a, output: routing.append(output[2].detach()))
        for fqn, module in model.module.named_modules()
        if fqn.endswith("mlp.gate")
    ]
    ids = _local_rows(_batch(0, arguments), model.mesh, "ep4")
    with torch.no_grad(), CommCounter(model.mesh) as counter:
        model(input_ids=ids, labels=ids)
    for hook in hooks:
        hook.remove()
    per_rank = arguments.experts // WORLD
    moved_pairs = sum(int((indices.reshape(-1) // per_rank != dist.get_rank()).sum()) for indices in routing)
    forward = [
        c for c in counter.calls if c.phase == FORWARD and (c.scope or "").endswith(("/dispatch", "/combine"))
    ]
    totals = torch.tensor(
        [
            sum(c.bytes_sent for c in forward if c.scope.endswith("/dispatch")),
            sum(c.bytes_sent for c in forward if c.scope.endswith("/combine")),
            moved_pairs * arguments.hidden * 4,
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(totals)
    tokens = arguments.batch * arguments.seq
    analytic = tokens * 2 * arguments.hidden * 4 * (WORLD - 1) / WORLD * arguments.layers
    return {
        "dispatch_measured": int(totals[0]),
        "combine_measured": int(totals[1]),
        "routed": int(totals[2]),
        "analytic": int(analytic),
    }


def _run(key: str, arguments: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    with PeakResident() as peak:
        result = _measured_run(key, arguments)
    result["peak"] = peak.growth
    return result


def _measured_run(key: str, arguments: argparse.Namespace) -> dict:
    import vescale

    model = _model(arguments)
    plan = _plan(model, key, arguments.batch)
    model, optimizer, _, _ = vescale.parallelize(
        plan, model, lambda module: torch.optim.SGD(module.parameters(), lr=0.1)
    )
    param_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.module.parameters()
    )
    times, losses = [], []
    for step in range(arguments.steps + 1):
        ids = _local_rows(_batch(step, arguments), model.mesh, key)
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step:
            times.append(float(elapsed))
        losses.append(float(loss.detach()))
    result = {"times": times, "losses": losses, "param_bytes": param_bytes}
    if key == "ep4":
        result["bytes"] = _all_to_all_bytes(model, arguments)
    return result


def main() -> None:
    from bench_rows import bench_parser

    parser = bench_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default=None, help="write run_all.py's rows here")
    arguments = parser.parse_args()
    # A first, unmeasured run imports the libraries and builds the process groups in every rank, so
    # the first measured plan does not pay for them.
    run_on_ranks(_run, WORLD, ("ep4", argparse.Namespace(**{**vars(arguments), "steps": 1})), timeout_s=1800)
    results = {}
    for key in PLANS:
        runs = run_on_ranks(_run, WORLD, (key, arguments), timeout_s=1800)
        results[key] = {
            "step_s": statistics.median(runs[0]["times"]),
            "times": runs[0]["times"],
            "peak_mib": max(run["peak"] for run in runs) / 2**20,
            "param_mib": max(run["param_bytes"] for run in runs) / 2**20,
            "loss0": runs[0]["losses"][0],
            "bytes": runs[0].get("bytes"),
        }
    shutdown_rank_pool()
    sizes = f"hidden {arguments.hidden}, {arguments.layers} layers, {arguments.experts} experts"
    print(f"MoE step, 4 ranks: {sizes}")
    print(f"{'plan':<6} {'step s':>8} {'peak MiB':>9} {'params MiB':>10} {'loss step 1':>12}")
    for key, row in results.items():
        print(
            f"{key:<6} {row['step_s']:>8.4f} {row['peak_mib']:>9.1f} {row['param_mib']:>10.2f} "
            f"{row['loss0']:>12.6f}"
        )
    moved = results["ep4"]["bytes"]
    print(
        "ep4 all-to-all bytes per forward, summed over ranks and blocks: "
        f"dispatch {moved['dispatch_measured']:,}, combine {moved['combine_measured']:,}, "
        f"routed (pairs changing rank x hidden x 4) {moved['routed']:,}, "
        f"analytic (tokens x k x hidden x 4 x (ep-1)/ep) {moved['analytic']:,}"
    )
    if arguments.json:
        from bench_rows import bench_row, write_rows

        rows = [
            bench_row(
                "moe_step",
                f"{key} vs dp4 (experts replicated)",
                results[key]["times"],
                results["dp4"]["times"],
                results[key]["peak_mib"],
                results["dp4"]["peak_mib"],
                time_goal=None,
                memory_goal=None,
                note="reported only",
            )
            for key in ("ep4", "tp4")
        ]
        write_rows(arguments.json, rows)


if __name__ == "__main__":
    main()
