"""A small GPT-style decoder (torch only) for the examples, benchmarks and tests.

Pre-LayerNorm blocks, causal SDPA attention with a fused QKV projection, a GELU
MLP, and an LM head tied to the token embedding. Example::

    >>> _ = torch.manual_seed(0)
    >>> cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=2)
    >>> model = GPT(cfg)
    >>> idx, targets = make_batch(cfg, 4, torch.Generator().manual_seed(0))
    >>> model(idx, targets).backward()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["GPTConfig", "GPT", "make_batch"]


@dataclass
class GPTConfig:
    """Model shape.

    Args:
        vocab_size: number of tokens. Default 50304.
        seq_len: maximum sequence length (learned positions). Default 1024.
        d_model: hidden size; must be divisible by ``n_heads``. Default 768.
        n_heads: attention heads. Default 12.
        n_layers: number of blocks. Default 12.
        mlp_ratio: MLP hidden size as a multiple of ``d_model``. Default 4.
        dropout: dropout probability (embeddings, attention, residuals). Default 0.0.
        tie_weights: share the LM head with the token embedding. Default True.
        checkpoint_blocks: recompute each block in backward
            (``torch.utils.checkpoint``, non-reentrant). Default False.
    """

    vocab_size: int = 50304
    seq_len: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_weights: bool = True
    checkpoint_blocks: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3, h, hd) -> three (b, h, t, hd) views of the one fused output.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model.

    ``forward(idx)`` returns logits of shape ``(batch, seq, vocab_size)``;
    ``forward(idx, targets)`` returns the mean cross-entropy loss (a scalar).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        checkpoint_blocks: bool | None = None,
    ) -> torch.Tensor:
        """Run the model; ``checkpoint_blocks`` overrides ``cfg.checkpoint_blocks``."""
        if checkpoint_blocks is None:
            checkpoint_blocks = self.cfg.checkpoint_blocks
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence length {t} > GPTConfig.seq_len ({self.cfg.seq_len})")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            if checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_batch(
    cfg: GPTConfig, batch_size: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random CPU token ids and next-token targets, each ``(batch_size, cfg.seq_len)``."""
    tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
