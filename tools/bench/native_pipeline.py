"""The pipeline a PyTorch engineer writes for a ``transformers`` Llama with ``torch.distributed.pipelining``.

torchtitan's recipe on ``transformers``' module names: build the model on the meta device, keep
this rank's stage (the embedding on the first, its decoder layers, the final norm and head on the
last), materialize and initialize only that, and drive a ``PipelineStage`` with one of PyTorch's
schedules; the last stage's loss is ``transformers``' own causal-LM loss of its micro-batch's
logits: with ``global_tokens`` (torchtitan's trainer) each micro-batch's summed token losses over
the global batch's label tokens, counted by one all-reduce over ``dp_group`` before the schedule
(times the dp size, which DDP's average divides again), the schedule's scaling off; without it
the micro-batch's mean, the schedule scaling the gradients by ``1 / n_microbatches``. With a
``dp_group``, each stage is a ``DistributedDataParallel`` module over it (gradients as bucket
views, 25 MB buckets): PyTorch's stage runs every micro-batch but the last under ``no_sync`` and
lets the last backward all-reduce, overlapped, as torchtitan's pipeline with DDP does. Used by
``e2e.py``'s pipeline pairs.

Example::

    pipeline = NativePipeline.build(config, mesh["pp"], cuts=(1, 2, 3), schedule="1f1b", microbatches=4)
    loss = pipeline.step(input_ids)          # the batch's loss on the last stage, else None
    optimizer = torch.optim.AdamW(pipeline.stage_module.parameters())
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

__all__ = ["LlamaStage", "NativePipeline", "global_label_tokens"]

_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def global_label_tokens(labels: torch.Tensor, dp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The loss terms of the global batch: the shifted labels not ignored (-100), summed over ``dp_group``
    (torchtitan's ``global_valid_tokens``)."""
    terms = (labels[:, 1:] != -100).sum()
    if dp_group is not None:
        dist.all_reduce(terms, group=dp_group)
    return terms


class LlamaStage(nn.Module):
    """Decoder layers ``layers`` of a ``LlamaForCausalLM``, with its embedding (``first``) and its
    norm and head (``last``); the forward is ``LlamaModel.forward``'s for these parts."""

    def __init__(self, model: transformers.LlamaForCausalLM, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[index] for index in layers)
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        # The rotary embedding has no parameters, only a buffer computed from the config.
        self.rotary_emb = LlamaRotaryEmbedding(model.config)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        hidden = tokens_or_hidden if self.embed_tokens is None else self.embed_tokens(tokens_or_hidden)
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
        if self.lm_head is None or self.norm is None:
            return hidden
        return self.lm_head(self.norm(hidden))


class NativePipeline:
    """This rank's stage of a Llama and the schedule that runs it (see the module docstring)."""

    def __init__(
        self,
        stage_module: LlamaStage,
        schedule: Schedule1F1B | ScheduleGPipe,
        *,
        first: bool,
        last: bool,
        dp_group: dist.ProcessGroup | None,
        global_tokens: bool,
    ):
        self.stage_module = stage_module
        self.schedule = schedule
        self.first, self.last = first, last
        self.dp_group, self.global_tokens = dp_group, global_tokens
        # The global batch's label tokens, counted before each step (with global_tokens).
        self.terms: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        config: transformers.LlamaConfig,
        pp_mesh: DeviceMesh,
        *,
        cuts: tuple[int, ...],
        schedule: str,
        microbatches: int,
        seed: int = 0,
        dp_group: dist.ProcessGroup | None = None,
        global_tokens: bool = False,
    ) -> NativePipeline:
        """Stage ``pp_mesh.get_local_rank()`` of the model cut before decoder layers ``cuts``,
        data-parallel over ``dp_group`` when given."""
        index, stages = pp_mesh.get_local_rank(), pp_mesh.size()
        if len(cuts) != stages - 1:
            raise ValueError(f"{stages} stages need {stages - 1} cuts, got {cuts}")
        bounds = (0, *cuts, config.num_hidden_layers)
        first, last = index == 0, index == stages - 1
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        stage_module = LlamaStage(model, range(bounds[index], bounds[index + 1]), first=first, last=last)
        rotary = stage_module.rotary_emb
        stage_module.to_empty(device="cpu")
        stage_module.rotary_emb = rotary  # to_empty would leave its buffer uninitialized
        torch.manual_seed(seed + index)
        for module in stage_module.modules():
            model._init_weights(module)
        vocab = config.vocab_size
        dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        pipeline: NativePipeline | None = None

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if pipeline is None or pipeline.terms is None:
                return ForCausalLMLoss(logits, labels, vocab)
            return ForCausalLMLoss(logits, labels, vocab, num_items_in_batch=pipeline.terms) * dp

        submodule: nn.Module = stage_module
        if dp_group is not None:
            submodule = DistributedDataParallel(
                stage_module, process_group=dp_group, bucket_cap_mb=25, gradient_as_bucket_view=True
            )
        stage = PipelineStage(submodule, index, stages, torch.device("cpu"), group=pp_mesh.get_group())
        runner = _SCHEDULES[schedule](
            stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=not global_tokens
        )
        pipeline = cls(
            stage_module, runner, first=first, last=last, dp_group=dp_group, global_tokens=global_tokens
        )
        return pipeline

    def step(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every micro-batch of ``input_ids`` (labels: the same tokens)."""
        losses: list[torch.Tensor] = []
        if self.global_tokens:  # every rank holds the batch's labels, as torchtitan's do
            self.terms = global_label_tokens(input_ids, self.dp_group)
        if self.first:
            self.schedule.step(input_ids, target=input_ids if self.last else None, losses=losses)
        elif self.last:
            self.schedule.step(target=input_ids, losses=losses)
        else:
            self.schedule.step()
        if not losses:
            return None
        total = torch.stack(losses).detach()
        return total.sum() if self.global_tokens else total.mean()
