"""Model-based test of the public API: two Offloaders driven through random sequences.

A ``hypothesis`` state machine holds two real :class:`ssdtrain.Offloader` objects (posix
engine, every activation of their small models offloaded), each with its own model
(tracked: ``set_plan`` applies), and applies in random order:

* ``forward``: a step's forward under ``with off:`` (or, when attached, the plain
  model call), its graph kept;
* ``backward``: a kept graph's backward, whose gradients must equal (``torch.equal``) a
  run without ssdtrain, or raise ``OffloaderClosedError`` once its offloader is closed;
* ``drop``: a kept graph or a saved handle dropped without use;
* ``save``: ``off.save(x)`` of an activation, a small tensor, or a value that is no
  tensor (``None``, an int, a string: an ``SSDTrainError`` saying so);
* ``restore``: a saved handle restored by its own offloader (equal to what was saved),
  by the other one (refused: another Offloader's handle), or a tensor passed as a
  handle (refused), each on an open or a closed offloader;
* ``set_plan`` (valid, an unknown choice, a wrong count), ``attach``/``detach`` of the
  offloader's model (twice: refused), ``close``.

Invariants after every step: no :class:`~ssdtrain.Stats` field, live-record count,
resident or spill byte count is ever negative; no bytes are resident with no live
record. At the end every graph and handle is dropped and each open offloader is back to
zero live records, resident bytes and spill bytes in use. Before this test existed,
``restore`` of the other offloader's handle was accepted and drove ``resident_bytes``
negative, and ``save(None)``/``restore(tensor)`` raised ``AttributeError``.

Derandomized (fixed seed, no example database); about 10-25 s. API_MODEL_EXAMPLES raises
the number of sequences, API_MODEL_SHRINK=1 shrinks a failure to a minimal example.
"""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)
from torch import nn

import ssdtrain

# Every activation of the models below (32 x 64 fp32 = 8 KiB) is offloaded.
CONFIG = dict(policy="static",
              engine="posix", min_tensor_bytes=4096, keep_tail_bytes=0, prefetch_bytes="64KiB",
              io_timeout_s=10)
NAMES = ("a", "b")
BATCH, WIDTH, DEPTH = 32, 64, 3


class Net(nn.Module):
    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.square().mean()


class Side:
    """One offloader, its model and what the machine keeps of it."""

    def __init__(self, name, spill_dir, seed):
        self.name = name
        self.model = Net(seed)
        self.x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed + 1))
        self.model.zero_grad(set_to_none=True)
        self.model(self.x).backward()
        self.reference = [p.grad.clone() for p in self.model.parameters()]
        self.off = ssdtrain.Offloader(spill_dir=spill_dir, **CONFIG)
        self.off.track(self.model)
        self.attached = False


def _act(seed):
    """A non-leaf activation (16 KiB): offloaded when saved."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(64, 64, generator=g, requires_grad=True) * 2).detach()


class APIMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sides = {}
        self.graphs = []    # (side, loss)
        self.handles = []   # (side, handle, tensor saved)

    @initialize()
    def setup(self):
        base = os.environ["API_MODEL_SPILL"]
        self.sides = {n: Side(n, base, seed=i * 10) for i, n in enumerate(NAMES)}

    def teardown(self):
        try:
            self.graphs.clear()
            self.handles.clear()
            gc.collect()
            for s in self.sides.values():
                if not s.off.closed:
                    s.off.wait()
                    gc.collect()
                    assert s.off.live_records() == 0, f"{s.name}: records live at the end"
                    assert s.off.resident_bytes() == 0, f"{s.name}: bytes resident at the end"
                    assert s.off.spill_bytes_in_use() == 0, f"{s.name}: spill slots in use"
        finally:
            for s in self.sides.values():
                s.off.detach()
                s.off.close()

    # ------------------------------------------------------------------ rules
    @rule(name=st.sampled_from(NAMES))
    def forward(self, name):
        s = self.sides[name]
        s.model.zero_grad(set_to_none=True)
        if s.off.closed:
            with pytest.raises(ssdtrain.OffloaderClosedError):
                with s.off:
                    s.model(s.x)
            return
        if s.attached:
            loss = s.model(s.x)
        else:
            with s.off:
                loss = s.model(s.x)
        assert not s.off.in_forward
        self.graphs.append((s, loss))

    @precondition(lambda self: self.graphs)
    @rule(i=st.integers(0, 1 << 16))
    def backward(self, i):
        s, loss = self.graphs.pop(i % len(self.graphs))
        s.model.zero_grad(set_to_none=True)
        if s.off.closed:
            with pytest.raises(ssdtrain.OffloaderClosedError):
                loss.backward()
            return
        loss.backward()
        for got, ref in zip((p.grad for p in s.model.parameters()), s.reference):
            assert torch.equal(got, ref), f"{s.name}: gradients differ from the reference"

    @precondition(lambda self: self.graphs or self.handles)
    @rule(i=st.integers(0, 1 << 16), graph=st.booleans())
    def drop(self, i, graph):
        items = self.graphs if (graph and self.graphs) or not self.handles else self.handles
        items.pop(i % len(items))
        gc.collect()

    @rule(name=st.sampled_from(NAMES), what=st.sampled_from(("activation", "small", None, 7, "x")),
          seed=st.integers(0, 100))
    def save(self, name, what, seed):
        s = self.sides[name]
        if what == "activation":
            value = _act(seed)
        elif what == "small":
            value = torch.arange(8.0) + seed
        else:
            value = what
        if not isinstance(value, torch.Tensor):
            with pytest.raises(ssdtrain.SSDTrainError, match="save\\(\\) takes a torch.Tensor"):
                s.off.save(value)
            return
        if s.off.closed:
            with pytest.raises(ssdtrain.OffloaderClosedError):
                s.off.save(value)
            return
        with s.off:
            handle = s.off.save(value)
        assert isinstance(handle, ssdtrain.SavedHandle)
        self.handles.append((s, handle, value))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 1 << 16), how=st.sampled_from(("own", "other", "tensor")))
    def restore(self, i, how):
        s, handle, value = self.handles[i % len(self.handles)]
        if how == "tensor":
            with pytest.raises(ssdtrain.SSDTrainError, match="not the tensor"):
                s.off.restore(value)
            return
        if how == "other":
            other = self.sides[NAMES[1 - NAMES.index(s.name)]]
            with pytest.raises(ssdtrain.SSDTrainError, match="another Offloader"):
                other.off.restore(handle)
            return
        if s.off.closed:
            with pytest.raises(ssdtrain.OffloaderClosedError):
                s.off.restore(handle)
            return
        got = s.off.restore(handle)
        assert torch.equal(got, value) and got.dtype == value.dtype

    @rule(name=st.sampled_from(NAMES), kind=st.sampled_from(("ok", "unknown", "count")),
          choices=st.lists(st.sampled_from(("keep", "offload")), min_size=DEPTH,
                           max_size=DEPTH))
    def set_plan(self, name, kind, choices):
        s = self.sides[name]
        if s.off.closed:
            with pytest.raises(ssdtrain.OffloaderClosedError):
                s.off.set_plan(choices)
            return
        if kind == "unknown":
            with pytest.raises(ssdtrain.ConfigError):
                s.off.set_plan(["sometimes"] + choices[1:])
        elif kind == "count":
            with pytest.raises(ssdtrain.SSDTrainError, match="plan choices"):
                s.off.set_plan(choices + ["keep"])
        else:
            assert tuple(s.off.set_plan(choices).choices) == tuple(choices)

    @rule(name=st.sampled_from(NAMES))
    def attach(self, name):
        s = self.sides[name]
        if s.off.closed:
            with pytest.raises(ssdtrain.OffloaderClosedError):
                s.off.attach(s.model)
        elif s.attached:
            with pytest.raises(ssdtrain.SSDTrainError, match="already attached"):
                s.off.attach(s.model)
        else:
            assert s.off.attach(s.model) is s.model
            s.attached = True

    @rule(name=st.sampled_from(NAMES))
    def detach(self, name):
        s = self.sides[name]
        s.off.detach(s.model)
        s.attached = False
        assert not s.model._forward_pre_hooks and not s.model._forward_hooks

    @rule(name=st.sampled_from(NAMES))
    def close(self, name):
        s = self.sides[name]
        s.off.close()
        assert s.off.closed

    # ------------------------------------------------------------- invariants
    @invariant()
    def no_counter_is_negative(self):
        for s in self.sides.values():
            stats = s.off.stats()
            for f in dataclasses.fields(stats):
                v = getattr(stats, f.name)
                if isinstance(v, (int, float)):
                    assert v >= 0, f"{s.name}: Stats.{f.name} = {v}"
            live, resident = s.off.live_records(), s.off.resident_bytes()
            assert live >= 0 and resident >= 0 and s.off.spill_bytes_in_use() >= 0, \
                (s.name, live, resident)
            if not live and resident and not s.off.closed:
                s.off.wait()  # a freed graph's writes still in flight hold their memory
                resident = s.off.resident_bytes()
            assert live or not resident, f"{s.name}: {resident} bytes resident, no live record"


SETTINGS = settings(max_examples=int(os.environ.get("API_MODEL_EXAMPLES", 12)),
                    stateful_step_count=20, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate] +
                    ([Phase.shrink] if os.environ.get("API_MODEL_SHRINK") else []),
                    suppress_health_check=list(HealthCheck))


def test_public_api_agrees_with_model(tmp_path, monkeypatch):
    monkeypatch.setenv("API_MODEL_SPILL", str(tmp_path))
    gc.collect()
    gc.freeze()  # as conftest does between tests: collections then scan only new objects
    run_state_machine_as_test(APIMachine, settings=SETTINGS)
