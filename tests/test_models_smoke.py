"""The test models themselves: they run in every dtype, are deterministic, and save
activations big enough for offloading to matter.

The equivalence tests compare two separately built copies of each model, so a
factory that is not bitwise reproducible would make them fail for the wrong reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
from models import ALL_MODELS  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MIN_LARGE_BYTES = 64 * 1024


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


def _step(make, dtype):
    model, inputs = make(dtype)
    loss = model(*inputs)
    loss.backward()
    return model, loss


def _saved_activation_bytes(make, dtype) -> list[int]:
    """Bytes of each tensor autograd saves in forward, parameters and buffers excluded."""
    model, inputs = make(dtype)
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in state:
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    loss.backward()
    return sizes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_forward_backward(name, dtype):
    model, loss = _step(ALL_MODELS[name], dtype)
    assert loss.dim() == 0 and loss.dtype == dtype
    assert torch.isfinite(loss)
    for pname, p in model.named_parameters():
        assert p.dtype == dtype, pname
        assert p.grad is not None, f"{name}.{pname} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}.{pname} has a non-finite gradient"
        assert p.grad.count_nonzero() > 0, f"{name}.{pname} has an all-zero gradient"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_factory_is_deterministic(name, dtype):
    make = ALL_MODELS[name]
    model_a, loss_a = _step(make, dtype)
    model_b, loss_b = _step(make, dtype)
    assert torch.equal(loss_a, loss_b)
    grads_a, grads_b = _grads(model_a), _grads(model_b)
    assert grads_a.keys() == grads_b.keys()
    for pname in grads_a:
        assert torch.equal(grads_a[pname], grads_b[pname]), f"{name}.{pname} differs between runs"


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_factory_leaves_global_rng_alone(name):
    before = torch.get_rng_state()
    ALL_MODELS[name](torch.float32)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_saves_large_activations(name, dtype):
    sizes = _saved_activation_bytes(ALL_MODELS[name], dtype)
    large = [s for s in sizes if s >= MIN_LARGE_BYTES]
    assert len(large) >= 2, f"{name}: saved activation sizes {sorted(sizes)}"
    assert sum(sizes) >= 512 * 1024, f"{name}: only {sum(sizes)} bytes of saved activations"


def test_gpt_checkpoint_blocks_matches_plain():
    make = ALL_MODELS["gpt"]
    plain, loss_plain = _step(make, torch.float32)
    model, inputs = make(torch.float32)
    loss_ckpt = model(*inputs, checkpoint_blocks=True)
    loss_ckpt.backward()
    assert torch.equal(loss_plain, loss_ckpt)
    for pname, grad in _grads(plain).items():
        assert torch.equal(grad, dict(model.named_parameters())[pname].grad), pname
