"""Which aten ops of one training step reach DTensor, and which of them lack a sharding strategy.

Runs one forward + backward of a tiny model under the test tensor-parallel plan on ``--tp``
local gloo ranks (``vescale.dtensor.testing``) and prints, forward and backward, each op
with its call count and whether DTensor has a strategy for it, then the coverage. Ops
without a strategy are computed on gathered tensors so that one run lists all of them.
``--table`` prints one row per model x TP x sequence parallelism instead.

    .venv/bin/python tools/op_coverage.py llama --tp 2 --sp
    .venv/bin/python tools/op_coverage.py qwen2 --tp 4          # any transformers model type
    .venv/bin/python tools/op_coverage.py --table llama mistral gpt2 mixtral nanogpt
"""

from __future__ import annotations

import argparse
import sys

from vescale.dtensor.ops.coverage import OpCoverageReport
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models.tp_step import StepResult, tensor_parallel_step


def _trace(name: str, tp: int, sequence_parallel: bool) -> StepResult:
    return run_on_ranks(
        tensor_parallel_step,
        tp,
        args=(name, tp),
        kwargs={"sequence_parallel": sequence_parallel, "replicate_uncovered": True},
        timeout_s=600,
    )[0]


def _combined(result: StepResult) -> OpCoverageReport:
    op_counts = dict(result.forward_ops.op_counts)
    for name, count in result.backward_ops.op_counts.items():
        op_counts[name] = op_counts.get(name, 0) + count
    uncovered = list(dict.fromkeys(result.forward_ops.uncovered + result.backward_ops.uncovered))
    return OpCoverageReport(op_counts=op_counts, uncovered=uncovered)


def _summary(report: OpCoverageReport) -> str:
    return f"{len(report.op_counts)} / {len(report.covered)} / {report.coverage_percent:.1f}%"


def print_report(name: str, tp: int, sequence_parallel: bool) -> bool:
    """Print the per-op tables of one run; True when every op is covered."""
    result = _trace(name, tp, sequence_parallel)
    print(f"# {name}, TP={tp}, sequence parallel {'on' if sequence_parallel else 'off'}")
    for phase, report in (("forward", result.forward_ops), ("backward", result.backward_ops)):
        print(f"\n## {phase}\n{report.format_table()}")
    total = _combined(result)
    print(
        f"\nforward and backward: ops seen {len(total.op_counts)}, covered {len(total.covered)}, "
        f"coverage {total.coverage_percent:.1f}%; missing: {total.uncovered or 'none'}"
    )
    return not total.uncovered


def print_table(names: list[str], tp_degrees: list[int]) -> bool:
    """Print one Markdown row per model x TP x SP (seen / covered / % for fwd, bwd, both)."""
    print(
        "| model | TP | SP | forward seen / covered / % | backward seen / covered / % | "
        "fwd+bwd seen / covered / % | missing |"
    )
    print("|---|---|---|---|---|---|---|")
    complete = True
    for name in names:
        for tp in tp_degrees:
            for sequence_parallel in (False, True):
                result = _trace(name, tp, sequence_parallel)
                total = _combined(result)
                complete &= not total.uncovered
                print(
                    f"| {name} | {tp} | {'on' if sequence_parallel else 'off'} | "
                    f"{_summary(result.forward_ops)} | {_summary(result.backward_ops)} | "
                    f"{_summary(total)} | {', '.join(total.uncovered) or '-'} |",
                    flush=True,
                )
    return complete


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "models", nargs="+", help="nanogpt, llama, mistral, gpt2, mixtral or a transformers model type"
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2], help="tensor-parallel degrees (ranks)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on (per-model reports)")
    parser.add_argument("--table", action="store_true", help="one row per model x TP x SP off/on")
    args = parser.parse_args(argv)
    if args.table:
        complete = print_table(args.models, args.tp)
    else:
        complete = all(print_report(name, tp, args.sp) for name in args.models for tp in args.tp)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
