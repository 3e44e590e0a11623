"""Property tests of INV-EXACT and INV-INPLACE (docs/ARCHITECTURE.md), driven by
hypothesis.

1. Random small graphs (views, transposes, expands, shared storages, legal in-place
   ops, mixed dtypes, ``retain_graph``) under random offloader settings: the loss and
   every gradient are bitwise equal to the same graph without ssdtrain.
2. In-place modification of a saved tensor (its input, output, a view of it or its
   base; kept in memory or offloaded; write finished or not): ssdtrain raises what
   autograd raises without hooks: a RuntimeError saying the variable "has been
   modified by an inplace operation", with the same observed and expected versions.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssdtrain

N = 64 * 64  # every tensor of the pool is (N,) fp32: 16 KiB


def _square(t):
    return t.reshape(64, 64)


# Each op takes two pool tensors and returns a new (N,) fp32 tensor.
OPS = {
    "sin": lambda a, b: a.sin(),                                     # saves its input
    "exp": lambda a, b: (a * 0.01).exp(),                            # saves its output
    "tanh": lambda a, b: a.tanh(),                                   # saves its output
    "mul": lambda a, b: a * b,                                       # saves both
    "mul_self": lambda a, b: a * a,                                  # one storage saved twice
    "transposed": lambda a, b: (_square(a).t() * _square(b)).reshape(N),  # strided view saved
    "halves": lambda a, b: torch.cat([(lambda v: v[0] * v[1])(a.view(2, N // 2))] * 2),
    "expand": lambda a, b: (a[:64].expand(64, 64) * _square(b)).reshape(N),  # stride-0 view
    "slice_mul": lambda a, b: torch.cat([a[::2] * b[1::2], a[1::2]]),  # offset views
    "matmul": lambda a, b: (_square(a) @ _square(b) * 0.05).reshape(N),
    "bf16": lambda a, b: a.to(torch.bfloat16).sin().to(torch.float32),
    "fp16": lambda a, b: (a.to(torch.float16) * b.to(torch.float16)).to(torch.float32),
    "fp64": lambda a, b: a.to(torch.float64).cos().to(torch.float32),
    "inplace_clone": lambda a, b: a.clone().mul_(1.5).sin(),         # legal in-place
    "inplace_slice": lambda a, b: _inplace_slice(a),                 # CopySlices
    "relu_": lambda a, b: torch.relu_(a - 0.1),                      # saves its in-place result
}


def _inplace_slice(a):
    c = a * 1.0
    c[::3].add_(0.5)
    return c.cos()


def _forward(program):
    """Leaves and loss of ``program``: a list of (op, i, j) over a growing pool."""
    g = torch.Generator().manual_seed(7)
    leaves = [torch.randn(N, generator=g).requires_grad_(),
              torch.randn(N, generator=g).requires_grad_()]
    pool = list(leaves)
    for op, i, j in program:
        pool.append(OPS[op](pool[i % len(pool)], pool[j % len(pool)]))
    loss = sum((t * (k + 1)).sum() for k, t in enumerate(pool[2:]))
    return leaves, loss


def _run(program, retain, off=None, settle=False):
    if off is None:
        leaves, loss = _forward(program)
    else:
        with off:
            leaves, loss = _forward(program)
            if settle:  # every write done: backward reads from disk, nothing forwarded
                off.wait()
    if retain:
        loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


SETTINGS = [dict(policy="static", min_tensor_bytes=1, keep_tail_bytes=0, prefetch_bytes=0),
            dict(policy="static", min_tensor_bytes=1, keep_tail_bytes=0, prefetch_bytes="64KiB"),
            dict(policy="static",
                 min_tensor_bytes=8192, keep_tail_bytes="32KiB", prefetch_bytes="16MiB"),
            dict(policy="static", min_tensor_bytes="1MiB")]  # everything kept in memory


@pytest.fixture(scope="module")
def offloaders(tmp_path_factory):
    d = tmp_path_factory.mktemp("spill")
    offs = [ssdtrain.Offloader(spill_dir=str(d), **s) for s in SETTINGS]
    yield offs
    for off in offs:
        off.close()


program_st = st.lists(st.tuples(st.sampled_from(sorted(OPS)), st.integers(0, 63),
                                st.integers(0, 63)), min_size=1, max_size=7)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(program=program_st, retain=st.booleans(), which=st.integers(0, len(SETTINGS) - 1),
       settle=st.booleans())
def test_random_graphs_give_exact_gradients(offloaders, program, retain, which, settle):
    off = offloaders[which]
    ref_loss, ref_grads = _run(program, retain)
    loss, grads = _run(program, retain, off, settle)
    # Bit for bit: a program that overflows (fp16, repeated squaring) gives NaN, which
    # torch.equal never finds equal to itself.
    assert torch.equal(loss.view(torch.int32), ref_loss.view(torch.int32))
    for r, g in zip(ref_grads, grads):
        assert (r is None) == (g is None)
        if r is not None:
            assert torch.equal(r.view(torch.int32), g.view(torch.int32))
    off.wait()
    assert off.live_records() == 0 and off.spill_bytes_in_use() == 0


def test_random_graphs_really_offload(offloaders):
    """The property above is not vacuous: the first settings write and read back."""
    off = offloaders[0]
    before = off.stats()
    _run([("sin", 0, 0), ("transposed", 2, 1), ("halves", 3, 0), ("bf16", 4, 0)], True, off,
         settle=True)
    off.wait()
    after = off.stats()
    assert after.records_written > before.records_written
    assert after.bytes_read > before.bytes_read


# ---------------------------------------------------------------- in-place errors
_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+) instead")


def _modify_saved(target, op, off=None, settle=False):
    """Saves a tensor, modifies it in place, runs backward; returns the error raised."""
    x = torch.randn(2 * N, generator=torch.Generator().manual_seed(3)).requires_grad_()
    base = x * 2
    h = base[:N] if target == "base of input" else base
    ctx = off if off is not None else _Null()
    with ctx:
        y = h.sin() if op == "sin" else h.exp() if op == "exp" else h * h
        loss = y.sum() if target != "output" else (y * 1.0).sum()
        if settle and off is not None:
            off.wait()
    if target in ("input", "base of input"):
        (base if target == "base of input" else h).add_(1)
    elif target == "view of input":
        h[::2].mul_(2)
    else:
        y.add_(1)
    try:
        loss.backward()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"  # not the error: its frames hold the graph
    return None


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["input", "view of input", "base of input", "output"]),
       op=st.sampled_from(["sin", "exp", "mul"]), which=st.integers(0, len(SETTINGS) - 1),
       settle=st.booleans())
def test_inplace_on_saved_tensor_raises_like_autograd(offloaders, target, op, which, settle):
    if (target == "output") != (op == "exp"):
        op = "exp" if target == "output" else "sin"  # exp saves its output only
    expected = _modify_saved(target, op)
    assert expected is not None, "autograd itself does not complain: bad test case"
    got = _modify_saved(target, op, offloaders[which], settle)
    assert got is not None, f"ssdtrain let backward use a modified saved tensor ({target}, {op})"
    assert "modified by an inplace operation" in str(expected)
    assert "modified by an inplace operation" in str(got), str(got)
    assert _VERSIONS.search(str(got)).groups() == _VERSIONS.search(str(expected)).groups()
    off = offloaders[which]
    off.wait()
    assert off.live_records() == 0 and off.spill_bytes_in_use() == 0
