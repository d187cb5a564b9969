"""A nanoGPT-style decoder-only language model, small enough for multi-rank CPU tests.

It follows Karpathy's nanoGPT (learned position embeddings, pre-norm blocks, GELU MLP,
causal scaled-dot-product attention, cross-entropy loss inside ``forward``) with two
changes that keep tensor-parallel plans plain: the query, key and value projections are
separate ``nn.Linear`` layers (nanoGPT fuses them into ``c_attn``), and the output head is
not tied to the token embedding.

Example::

    model = NanoGPT(NanoGPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32))
    loss = model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))[1]
    loss.backward()
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NanoGPT", "NanoGPTConfig"]


@dataclass(frozen=True)
class NanoGPTConfig:
    """The sizes of a :class:`NanoGPT`; the defaults are tiny on purpose."""

    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # No key bias: it adds the same q.b to every score of a row, which softmax cancels, so its
        # gradient is identically zero (Whisper drops it for the same reason).
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = hidden_states.shape
        # -1 heads: under tensor parallelism the local projection holds only some heads.
        head_shape = (batch, seq_len, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(head_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(head_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(head_shape).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        output: torch.Tensor = self.c_proj(attended.transpose(1, 2).reshape(batch, seq_len, -1))
        return output


class MLP(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.c_proj(self.gelu(self.c_fc(hidden_states)))
        return output


class Block(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states))
        output: torch.Tensor = hidden_states + self.mlp(self.ln_2(hidden_states))
        return output


class NanoGPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a final LayerNorm and an LM head.

    ``forward(input_ids, labels=None)`` returns ``(logits, loss)``; ``loss`` is ``None``
    without labels. Labels are the next-token targets, already aligned with ``input_ids``.

    Example::

        model = NanoGPT(NanoGPTConfig())
        logits, _ = model(torch.randint(0, 64, (2, 8)))
        assert logits.shape == (2, 8, 64)
    """

    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections.
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq_len = input_ids.shape[1]
        if seq_len > self.config.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.config.block_size}")
        positions = torch.arange(seq_len, dtype=torch.long, device=input_ids.device)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            hidden_states = block(hidden_states)
        logits = self.lm_head(self.ln_f(hidden_states))
        if labels is None:
            return logits, None
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
        )
        return logits, loss
