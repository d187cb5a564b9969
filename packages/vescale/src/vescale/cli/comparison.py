"""The two loss curves of ``--compare-single-device`` side by side, and how far they agree.

Relative error as the project measures it: ``max |parallel - reference| / max |reference|``
over the steps. The issue's bound is 1e-4; with deterministic data parallelism and no tensor or
pipeline split the curves are equal bit for bit, and the output says so.

Example::

    print(comparison_table(parallel_losses, reference_losses, layout))
"""

from __future__ import annotations

from vescale.cli.run_layout import RunLayout

__all__ = ["AGREEMENT_RTOL", "agreement_summary", "comparison_table", "max_relative_difference"]

AGREEMENT_RTOL = 1e-4
"""The relative difference of the loss curves that ``vescale train`` reports against (issue #9)."""


def max_relative_difference(parallel: list[float], reference: list[float]) -> float:
    """``max |parallel - reference| / max |reference|`` over the steps (the guide's relative error).

    Example::

        max_relative_difference([2.0, 1.5], [2.0, 1.5])   # 0.0
    """
    scale = max(abs(value) for value in reference)
    return max(abs(p - r) for p, r in zip(parallel, reference, strict=True)) / scale


_BITWISE_REASON = (
    "deterministic data parallelism: the ranks' gradients are summed in rank order, as the "
    "reference accumulates the same micro-batches"
)


def _rounding_reasons(layout: RunLayout) -> str:
    """Why a run one process cannot repeat exactly rounds differently (``reproducible_bitwise`` false)."""
    reasons = []
    if layout.tensor_parallel > 1:
        reasons.append(
            f"tensor parallelism (tp={layout.tensor_parallel}) adds partial matmul sums across ranks"
        )
    if layout.pipeline_parallel > 1:
        reasons.append(
            f"the pipeline (pp={layout.pipeline_parallel}) accumulates in its own schedule's order"
        )
    if not layout.deterministic:
        reasons.append("the data-parallel all-reduce sums in the backend's order")
    if layout.device_type != "cpu":
        reasons.append(f"the ranks ran {layout.device_type} kernels, the reference CPU ones")
    return "; ".join(reasons) + ": float32 rounding differs from one process, and training amplifies it"


def agreement_summary(parallel: list[float], reference: list[float], layout: RunLayout) -> list[str]:
    """The lines that say how far the curves agree: bitwise, or the largest difference and its step.

    Example::

        print("\\n".join(agreement_summary(parallel_losses, reference_losses, layout)))
    """
    steps = len(reference)
    if parallel == reference:
        reason = f" ({_BITWISE_REASON})" if layout.reproducible_bitwise else ""
        return [f"the curves are bitwise equal at all {steps} steps{reason}"]
    scale = max(abs(value) for value in reference)
    differences = [abs(p - r) / scale for p, r in zip(parallel, reference, strict=True)]
    worst = max(range(steps), key=differences.__getitem__)
    equal_steps = next(step for step in range(steps) if parallel[step] != reference[step])
    equal_part = f"equal bit for bit up to step {equal_steps}" if equal_steps else "unequal from step 1"
    lines = [
        f"max relative difference over {steps} steps: {differences[worst]:.2e} at step {worst + 1} "
        f"({equal_part})",
    ]
    beyond = next((step for step in range(steps) if differences[step] > AGREEMENT_RTOL), None)
    if beyond is None:
        lines.append(f"the curves agree within {AGREEMENT_RTOL:.0e} relative at every step")
    else:
        lines.append(f"the curves agree within {AGREEMENT_RTOL:.0e} relative up to step {beyond}")
    if layout.reproducible_bitwise:
        lines.append(
            "why not bitwise: unexpected, the reference repeats this run's sums in the same order; "
            "please report it to veScale with this output"
        )
    else:
        lines.append(f"why not bitwise: {_rounding_reasons(layout)}")
    return lines


def comparison_table(parallel: list[float], reference: list[float], layout: RunLayout, rows: int = 20) -> str:
    """Both loss curves side by side (about ``rows`` evenly spaced steps) and their agreement.

    Example::

        print(comparison_table(parallel_losses, reference_losses, layout))
    """
    every = max(1, len(reference) // rows)
    shown = sorted({*range(0, len(reference), every), len(reference) - 1})
    lines = [f"{'step':>6}  {'vescale':>12}  {'single device':>13}  {'rel. diff':>9}", "-" * 46]
    for index in shown:
        difference = abs(parallel[index] - reference[index]) / abs(reference[index])
        lines.append(
            f"{index + 1:>6}  {parallel[index]:>12.6f}  {reference[index]:>13.6f}  {difference:>9.1e}"
        )
    lines += agreement_summary(parallel, reference, layout)
    return "\n".join(lines)
