"""A Llama-3-shaped decoder stack (torch only) for long-context fine-tuning benchmarks.

RMSNorm pre-norm blocks, rotary positions, grouped-query attention (causal SDPA)
and a SwiGLU MLP, as in Llama 3. The base weights are frozen and low-rank adapters
(LoRA) on the query and value projections are trained, as in a LoRA fine-tune. The
stack takes hidden states (no token embedding) and its loss is the mean square of a
fixed 64-wide projection of the final norm's output: no LM head, so the vocabulary
does not set the memory or the time of a step, and what is measured is the layers'. Example::

    >>> _ = torch.manual_seed(0)
    >>> cfg = LlamaConfig(hidden=64, n_heads=4, n_kv_heads=2, ffn=128, n_layers=2)
    >>> model = LlamaStack(cfg)
    >>> x = make_hidden(cfg, 1, 32, torch.Generator().manual_seed(0))
    >>> model(x).backward()

``LlamaConfig()`` is Llama-3-8B's layer shape (hidden 4096, 32 heads, 8 KV heads,
SwiGLU 14336); ``n_layers`` picks how many of its 32 layers to build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "LlamaStack", "make_hidden", "layer_input_bytes"]


@dataclass
class LlamaConfig:
    """Shape of the stack.

    Args:
        hidden: model width. Default 4096.
        n_heads: query heads; ``hidden`` must be divisible by it. Default 32.
        n_kv_heads: key/value heads; ``n_heads`` must be divisible by it. Default 8.
        ffn: SwiGLU inner width. Default 14336.
        n_layers: blocks. Default 32.
        lora_rank: rank of the adapters on the query and value projections. Default 16.
        rope_theta: rotary base. Default 500000.0.
    """

    hidden: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn: int = 14336
    n_layers: int = 32
    lora_rank: int = 16
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: hidden ({self.hidden}) must be divisible by n_heads "
                             f"({self.n_heads}), and n_heads by n_kv_heads ({self.n_kv_heads})")
        if (self.hidden // self.n_heads) % 2:
            raise ValueError(f"LlamaConfig: the head size ({self.hidden // self.n_heads}) must "
                             f"be even for rotary positions")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


class LoRALinear(nn.Module):
    """A frozen linear map plus a trained low-rank update ``B @ A`` (scale 2)."""

    def __init__(self, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        # Not zero (as LoRA starts) so that both adapters get a gradient to compare.
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 2.0 * F.linear(F.linear(x, self.lora_a), self.lora_b)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head = cfg.hidden // cfg.n_heads
        kv = self.n_kv * self.head
        self.q = LoRALinear(cfg.hidden, cfg.hidden, cfg.lora_rank)
        self.k = nn.Linear(cfg.hidden, kv, bias=False)
        self.v = LoRALinear(cfg.hidden, kv, cfg.lora_rank)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        for m in (self.k, self.o):
            m.weight.requires_grad_(False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, self.head).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv, self.head).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv, self.head).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.theta = cfg.rope_theta
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        for m in (self.attn_norm, self.mlp_norm, self.gate, self.up, self.down):
            for p in m.parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, head = x.shape[1], self.attn.head
        pos = torch.arange(t, device=x.device, dtype=torch.float32)
        inv = 1.0 / (self.theta ** (torch.arange(0, head, 2, device=x.device,
                                                  dtype=torch.float32) / head))
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaStack(nn.Module):
    """``n_layers`` Llama blocks, a final norm and a frozen 64-wide projection;
    ``forward(x)`` returns the loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.hidden)
        self.norm.weight.requires_grad_(False)
        self.probe = nn.Linear(cfg.hidden, 64, bias=False)  # in place of an LM head
        self.probe.weight.requires_grad_(False)
        for p in self.parameters():
            if not p.requires_grad and p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor, layer_call=None) -> torch.Tensor:
        """The loss of hidden states ``x`` (batch, seq, hidden). ``layer_call(layer, x)``
        runs each layer (default: ``layer(x)``): a benchmark passes checkpointing here."""
        for layer in self.layers:
            x = layer(x) if layer_call is None else layer_call(layer, x)
        return self.probe(self.norm(x)).float().pow(2).mean()


def make_hidden(cfg: LlamaConfig, batch: int, seq: int,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Random CPU hidden states ``(batch, seq, hidden)`` (float32; cast as needed)."""
    return torch.randn(batch, seq, cfg.hidden, generator=generator)


def layer_input_bytes(cfg: LlamaConfig, batch: int, seq: int, element_size: int = 2) -> int:
    """Bytes of one layer's input: what recomputation with offloaded inputs moves per layer."""
    return batch * seq * cfg.hidden * element_size
