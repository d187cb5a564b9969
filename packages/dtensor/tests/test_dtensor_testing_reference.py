"""The test kit's single-process reference and its comparisons (``vescale.dtensor.testing``)."""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor.testing.models.mlp import build_tiny_mlp, mlp_batches, mse_loss
from vescale.dtensor.testing.numerics import assert_close_by_fqn, assert_losses_close, sgd_step_gradients
from vescale.dtensor.testing.reference import assert_matches_reference, train_reference


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_micro_batches_give_the_whole_batch_gradient_up_to_rounding():
    batches = mlp_batches(steps=3, rows=8)
    whole = train_reference(build_tiny_mlp, batches, adamw, loss_fn=mse_loss)
    pieces = train_reference(build_tiny_mlp, batches, adamw, loss_fn=mse_loss, micro_batches=4)
    divided = train_reference(
        build_tiny_mlp, batches, adamw, loss_fn=mse_loss, micro_batches=4, divide_gradients=True
    )
    assert len(whole.losses) == len(whole.gradients) == len(whole.optimizer_states) == 3
    assert set(whole.gradients[0]) == set(whole.parameters) == set(whole.optimizer_states[0])
    assert set(whole.optimizer_states[-1]["head.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    # Equal pieces: the mean of the pieces' means is the whole mean (float32 reordering only).
    for run in (pieces, divided):
        assert_losses_close(run.losses, whole.losses, 1e-6)
        assert_close_by_fqn(run.gradients[0], whole.gradients[0], 1e-6)
    assert not torch.equal(pieces.gradients[0]["head.weight"], whole.gradients[0]["head.weight"])


def test_the_comparison_names_the_worst_fqn_and_sgd_reads_gradients_back():
    run = train_reference(build_tiny_mlp, mlp_batches(1, 8), adamw, loss_fn=mse_loss, max_norm=0.05)
    assert run.grad_norms[0] > 0.05  # clipped: the recorded gradients are the clipped ones
    doubled = {fqn: grad * (2 if fqn == "head.bias" else 1) for fqn, grad in run.gradients[0].items()}
    with pytest.raises(AssertionError, match=r"gradient of head\.bias: relative error 1\.00e\+00"):
        assert_close_by_fqn(doubled, run.gradients[0], 1e-5)
    with pytest.raises(AssertionError, match=r"loss of step 0"):
        assert_losses_close([run.losses[0] * 1.01], run.losses, 1e-4)

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e3)

    step = train_reference(build_tiny_mlp, mlp_batches(1, 8), sgd, loss_fn=mse_loss)
    read_back = sgd_step_gradients(step.initial_parameters, step.parameters, lr=1e3)
    assert assert_close_by_fqn(read_back, step.gradients[0], 1e-6) <= 1e-6


def test_matching_merges_the_ranks_gradients_and_names_what_no_rank_returned():
    run = train_reference(build_tiny_mlp, mlp_batches(2, 8), adamw, loss_fn=mse_loss)
    stage_0 = {fqn: grad for fqn, grad in run.gradients[0].items() if fqn.startswith("blocks.")}
    stage_1 = {fqn: grad for fqn, grad in run.gradients[0].items() if fqn.startswith("head.")}
    errors = assert_matches_reference(run, [run.losses], [stage_0, stage_1], loss_rtol=0.0, grad_rtol=0.0)
    assert errors == (0.0, 0.0)
    with pytest.raises(AssertionError, match=r"pp: no rank returned the gradient of \['head\.bias'"):
        assert_matches_reference(run, gradients=[stage_0], loss_rtol=0.0, grad_rtol=0.0, label="pp")
