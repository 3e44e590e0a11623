"""Small models for the equivalence tests.

Every factory has the same signature::

    make(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]

It returns a fresh model, already cast to ``dtype`` and in train mode, and the
inputs for one step; floating-point inputs are cast to ``dtype``, integer inputs
(token ids, labels) stay int64. The model's forward returns a scalar loss::

    model, inputs = ALL_MODELS["gpt"](torch.bfloat16)
    model(*inputs).backward()

Parameters are drawn under a fixed seed inside ``torch.random.fork_rng`` (the
global RNG is left untouched) and inputs from a seeded ``torch.Generator``, so two
calls with the same dtype give identical models and inputs, and on the same
machine bitwise-identical gradients. All models run in fp32, bf16 and fp16 on the
CPU; each saves several activations of 64 KiB or more (in fp32; half that in
16-bit dtypes for most, with at least one still >= 64 KiB).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from gpt import GPT, GPTConfig, make_batch  # noqa: E402

__all__ = ["mlp", "cnn", "gpt", "tied", "inplace_views", "ALL_MODELS"]

_PARAM_SEED = 1234
_INPUT_SEED = 4321

Inputs = tuple[torch.Tensor, ...]


def _build(ctor, dtype: torch.dtype) -> nn.Module:
    """Construct ``ctor()`` under a fixed seed without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_PARAM_SEED)
        model = ctor()
    return model.to(dtype).train()


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(_INPUT_SEED)


class _MLP(nn.Module):
    def __init__(self, d: int = 256, hidden: int = 1024, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def mlp(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
    """LayerNorm/Linear/GELU stack on a (64, 256) batch; MSE loss."""
    g = _gen()
    x = torch.randn(64, 256, generator=g)
    y = torch.randn(64, 256, generator=g)
    return _build(_MLP, dtype), (x.to(dtype), y.to(dtype))


class _CNN(nn.Module):
    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 8 * 8, n_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.features(images).flatten(1)), labels)


def cnn(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
    """Conv/BatchNorm (train mode)/ReLU/MaxPool/Linear on 4x3x32x32 images.

    Batch 4 because fp16 convolution on the CPU takes a slow path (~3x slower at 8).
    """
    g = _gen()
    images = torch.randn(4, 3, 32, 32, generator=g)
    labels = torch.randint(10, (4,), generator=g)
    return _build(_CNN, dtype), (images.to(dtype), labels)


_GPT_CONFIG = GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_heads=4, n_layers=2)


def gpt(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
    """``examples/gpt.py``: 2 layers, SDPA attention, tied LM head; batch 4 x 64 tokens."""
    idx, targets = make_batch(_GPT_CONFIG, 4, _gen())
    return _build(lambda: GPT(_GPT_CONFIG), dtype), (idx, targets)


class _Tied(nn.Module):
    """The embedding weight is the output projection; ``mix`` is applied twice."""

    def __init__(self, vocab: int = 1024, d: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        # Unit-variance logits: LayerNorm output (unit) dotted with rows of std d**-0.5.
        nn.init.normal_(self.emb.weight, std=d**-0.5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + torch.tanh(self.mix(h))
        h = h + torch.tanh(self.mix(h))
        logits = F.linear(self.norm(h), self.emb.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tied(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
    """Shared weights: embedding reused as LM head, one Linear used twice; 8 x 32 tokens."""
    g = _gen()
    idx = torch.randint(1024, (8, 32), generator=g)
    targets = torch.randint(1024, (8, 32), generator=g)
    return _build(_Tied, dtype), (idx, targets)


class _InplaceViews(nn.Module):
    """Exercises the storage-sharing cases that an offloader must rebuild exactly.

    - one fused projection split three ways (basic slice, ``narrow``,
      ``as_strided``), each part saved by a different matmul;
    - a transposed (non-contiguous) tensor saved by ``mm``;
    - ``expand`` (stride 0) saved by ``mul``;
    - in-place ``relu_`` on a fresh intermediate and ``add_`` into a fresh buffer;
    - one tensor saved by two different ops (``sin`` and ``mul``);
    - ``torch.cat`` and ``torch.stack`` feeding ops that save their results.
    """

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.d = d
        self.inp = nn.Linear(d, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.fc = nn.Linear(d, d)
        self.mix = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.inp(x)
        fused = self.qkv(h)  # (b, t, 3d), contiguous
        q = fused[..., :d]
        k = fused.narrow(-1, d, d)
        v = fused.as_strided((b, t, d), fused.stride(), fused.storage_offset() + 2 * d)
        att = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)
        y = att @ v  # (b, t, d)

        z = self.fc(h + y)
        z.relu_()  # fresh output of addmm: nothing saved it yet
        buf = torch.zeros_like(z)
        buf.add_(z)
        gate = h.mean(dim=1, keepdim=True).expand(b, t, d)
        w = buf * gate  # saves the stride-0 expand

        m = w.reshape(b * t, d)
        gram = torch.mm(m.t(), m.tanh()) / (b * t)  # saves m.t(), non-contiguous
        u = w + torch.mm(m, gram @ self.mix).view(b, t, d)  # m saved again, by another mm
        shared = u.sin() + u * z  # u saved by sin and by mul

        c = torch.cat([shared, q], dim=-1)  # (b, t, 2d)
        s = torch.stack([self.out(c), y], dim=0)  # (2, b, t, d)
        return (s * s).sum() / (b * t)


def inplace_views(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Inputs]:
    """In-place ops, views of one fused tensor, expand, transpose, cat/stack; (8, 64, 64) input."""
    x = torch.randn(8, 64, 64, generator=_gen())
    return _build(_InplaceViews, dtype), (x.to(dtype),)


ALL_MODELS = {
    "mlp": mlp,
    "cnn": cnn,
    "gpt": gpt,
    "tied": tied,
    "inplace_views": inplace_views,
}
