"""NOTE [ Loads in time ] (ssdtrain/_policies/auto.py): under ``policy="auto"`` the prefetch window
leads the quota's loads by the time they take, never beyond what the step held at
forward's end, and the quota's bound counts on that lead. Searched: the window's rule
over random measurements (bounds, monotone in the load rate, ``prefetch_bytes`` where
nothing asks for more); on the loopback device, with loads that take time, the lead
starts them earlier in backward, what is held ahead of use stays within the window, and
the trained model equals a run without ssdtrain."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import testing
from ssdtrain._policies import auto as _auto
from ssdtrain._policies.auto import AutoQuota, quota_bound
from ssdtrain.tools import pin_auto_quota, set_load_lead
from loopback_helpers import LoopbackDevice, attach
from models import ALL_MODELS

MiB = 1 << 20
GiB = 1 << 30


def _ctl(quota, saved, forward_s, step_s, copy_read=None, disk_read=None, host=1 << 62):
    ctl = AutoQuota(0.03, None, ssdtrain.Stats(), host_bytes=host, window_bytes=256 * MiB)
    ctl.quota, ctl._saved = quota, saved
    ctl.base_forward_s, ctl.base_step_s = forward_s, step_s
    ctl.copy_read_bps, ctl.read_bps = copy_read, disk_read
    return ctl


def test_the_h200_trace_s_step_gets_the_lead_it_lacked():
    """The figures of docs/results/gpu_trace_2026-11-28.md: S 10075 MiB, 1/16 of it
    offloaded, backward ~70 ms, ~57 GB/s host-to-device: the loads need ~12 ms, of which
    backward's own use of those bytes hides ~4: the window is the bytes backward uses in
    1.5x the other ~8 ms, about 1.8 GiB instead of 256 MiB."""
    s, q = 10075 * MiB, 10075 * MiB // 16
    ctl = _ctl(q, s, 0.035, 0.105, copy_read=57e9)
    back = 0.07
    lead = q / 57e9 - q * back / s
    want = int(_auto.LEAD_MARGIN * lead * s / back)
    assert ctl.window(256 * MiB) == want and 1.5 * GiB < want < 2.5 * GiB
    assert ctl._stats.prefetch_window_bytes == want


@settings(max_examples=300, deadline=None)
@given(saved=st.integers(1 * MiB, 64 * GiB), share=st.floats(0.0, 1.0),
       forward=st.floats(0.001, 5.0), back=st.floats(0.001, 10.0),
       copy_read=st.one_of(st.none(), st.floats(1e8, 1e11)),
       disk_read=st.one_of(st.none(), st.floats(1e7, 1e10)),
       host=st.integers(0, 64 * GiB), prefetch=st.integers(0, 4 * GiB))
def test_window_rule(saved, share, forward, back, copy_read, disk_read, host, prefetch):
    """Never below ``prefetch_bytes``; above it never more than ``S - Q`` (what forward's
    end held); ``prefetch_bytes`` when leads are off, with no quota or no measured time;
    a slower load never gets a smaller window."""
    q = int(share * saved)
    ctl = _ctl(q, saved, forward, forward + back, copy_read, disk_read, host)
    w = ctl.window(prefetch)
    assert w >= prefetch
    if w > prefetch:
        assert w <= saved - q
    ctl.leads = False
    assert ctl.window(prefetch) == prefetch
    ctl.leads = True
    for rate in ("copy_read_bps", "read_bps"):
        if getattr(ctl, rate):
            setattr(ctl, rate, getattr(ctl, rate) / 2)
            assert ctl.window(prefetch) >= w
    for unmeasured in (dict(quota=None), dict(quota=0), dict(base_step_s=math.inf)):
        c = _ctl(q, saved, forward, forward + back, copy_read, disk_read, host)
        for k, v in unmeasured.items():
            setattr(c, k, v)
        assert c.window(prefetch) == prefetch


@settings(max_examples=200, deadline=None)
@given(saved=st.integers(1 * MiB, 64 * GiB), forward=st.floats(0.001, 5.0),
       back=st.floats(0.001, 10.0), copy_read=st.floats(1e8, 1e11),
       copy_write=st.floats(1e8, 1e11))
def test_the_bound_counts_on_the_lead(saved, forward, back, copy_read, copy_write):
    """With leads the quota's bound is the one whose reads start as backward does (no
    window); without, the fixed window's; and a bound whose loads keep up (``Q / R <=
    B``) gets a window within ``S - Q``, so the lead it counts on is the one it gets."""
    ctl = _ctl(0, saved, forward, forward + back, copy_read)
    ctl.copy_write_bps = copy_write
    lead = ctl._bound(saved)
    assert lead == quota_bound(saved, forward, forward + back, copy_write, copy_read, 0.03)
    ctl.leads = False
    assert ctl._bound(saved) == quota_bound(saved, forward, forward + back, copy_write,
                                            copy_read, 0.03, window_bytes=256 * MiB)
    ctl.leads = True
    if 0 < lead < saved and lead / copy_read <= back:
        ctl.quota = lead
        need = (lead / copy_read - lead * back / saved) * saved / back
        assert need <= saved - lead + 1


class _Chain(torch.nn.Module):
    """Layers whose saved tensors are all large: a chain of matmuls and tanh. ``marks``
    (if set) is called as backward reaches each layer's output: backward's progress,
    seen whether ssdtrain's hooks are on or not."""

    def __init__(self, d=256, depth=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(depth))
        self.marks = None

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if self.marks is not None and x.requires_grad:
                x.register_hook(lambda g: self.marks())
        return x.square().mean()


def _lead_run(tmp_path, lead, steps=4):
    """``steps`` steps of the chain under auto with a pinned quota of half its bytes
    (host tier, loads that take 2 ms each), the controller told that backward is long
    and loads slow: per step, how many layers' backward ran before the first load
    started, and the most held ahead of use over the window."""
    torch.manual_seed(0)
    model, x = _Chain(), torch.randn(64, 256)
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=None, host_budget_bytes="unlimited", policy="auto", min_tensor_bytes=4096,
        keep_tail_bytes=0, prefetch_bytes=64 << 10))
    attach(off, LoopbackDevice(claim_host_tensors=True, h2d_delay=0.002))
    set_load_lead(off, lead)
    seen, marks = [], []

    def queued():
        return testing.prefetch(off).queued

    def spying(unpack):
        def spy(h):
            window = testing.prefetch(off)
            seen.append((window.queued, window.ahead, testing.prefetch_window(off)))
            return unpack(h)
        return spy
    testing.wrap_hooks(off, unpack=spying)
    model.marks = lambda: marks.append(queued())
    with off:  # the first step counts what a step saves
        model(x)
    saved = off.stats().unique_bytes
    pin_auto_quota(off, saved // 2)
    ctl = off._auto
    window = ctl.window

    def told(prefetch):  # what the step's measurements would have said: loads are slow
        ctl.base_forward_s, ctl.base_step_s, ctl.copy_read_bps = 0.01, 0.03, 1e7
        return window(prefetch)
    ctl.window = told
    firsts, over = [], []
    try:
        for _ in range(steps):
            seen.clear()
            marks.clear()
            with off:
                loss = model(x)
            loss.backward()
            off.wait()
            # How many layers' backward ran before the first load was started.
            firsts.append(next((i for i, n in enumerate(marks) if n < marks[0]), len(marks)))
            over.extend(a - w for _, a, w in seen)
        return firsts, max(over), off.stats(), saved
    finally:
        off.close()


def test_the_lead_starts_loads_earlier_and_stays_within_its_window(tmp_path):
    with_lead, over_lead, st_lead, saved = _lead_run(tmp_path, True)
    without, over_fixed, st_fixed, _ = _lead_run(tmp_path, False)
    assert st_lead.prefetch_window_bytes > 64 << 10 == st_fixed.prefetch_window_bytes
    assert st_lead.prefetch_window_bytes <= saved - saved // 2
    # The quota's loads start after fewer of backward's layers.
    assert all(a < b for a, b in zip(with_lead[1:], without[1:])), (with_lead, without)
    one_record = 64 * 256 * 4
    assert over_lead <= one_record and over_fixed <= one_record


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(sorted(ALL_MODELS)), share=st.floats(0.0, 1.0),
       copy_read=st.floats(1e6, 1e10))
def test_the_lead_trains_the_same_model(tmp_path_factory, name, share, copy_read):
    """On the loopback device (host tier), any quota and any measured load rate: four
    SGD steps equal the run without ssdtrain (every gradient, every parameter)."""
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[name](torch.float32)
    ref_model = copy.deepcopy(model)
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    ref = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        ref_model(*inputs).backward()
        ref.append({n: p.grad.clone() for n, p in ref_model.named_parameters()})
        opt.step()
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=None, host_budget_bytes="unlimited", policy="auto", min_tensor_bytes=1024,
        prefetch_bytes=8 << 10))
    attach(off, LoopbackDevice(claim_host_tensors=True))
    try:
        got_model = copy.deepcopy(model)
        opt = torch.optim.SGD(got_model.parameters(), lr=0.05)
        for i in range(4):
            if i == 1:
                pin_auto_quota(off, int(share * off.stats().unique_bytes))
                ctl, window = off._auto, off._auto.window

                def told(prefetch, ctl=ctl, window=window):
                    ctl.base_forward_s, ctl.base_step_s = 0.01, 0.03
                    ctl.copy_read_bps = copy_read
                    return window(prefetch)
                ctl.window = told
            opt.zero_grad(set_to_none=True)
            with off:
                loss = got_model(*inputs)
            loss.backward()
            for n, p in got_model.named_parameters():
                assert torch.equal(p.grad, ref[i][n]), (n, i)
            opt.step()
        for (n, a), (_, b) in zip(ref_model.state_dict().items(),
                                  got_model.state_dict().items()):
            assert torch.equal(a, b), n
    finally:
        off.close()


def test_set_load_lead_checks_its_input(tmp_path):
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=str(tmp_path), policy="auto"))
    try:
        with pytest.raises(ssdtrain.ConfigError, match="True or False"):
            set_load_lead(off, "no")
    finally:
        off.close()
    static = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=str(tmp_path), policy="static"))
    try:
        with pytest.raises(ssdtrain.ConfigError, match="policy='auto'"):
            set_load_lead(static, False)
    finally:
        static.close()


@pytest.mark.parametrize("prefetch", [0, 1, 4096])
def test_the_window_is_prefetch_bytes_itself_where_nothing_asks_for_more(tmp_path, prefetch):
    """No lead (nothing measured yet, or loads that keep up): the window is exactly
    ``prefetch_bytes``, 0 included (nothing read ahead: no record is loaded before
    backward asks for it)."""
    dev = LoopbackDevice()
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=None, host_budget_bytes="unlimited", policy="auto", min_tensor_bytes=4096,
        keep_tail_bytes=0, prefetch_bytes=prefetch))
    attach(off, dev)
    try:
        for _ in range(3):
            x = dev.alloc((4096,)).requires_grad_()
            with off:
                loss = (x * x).sum()
            off.wait()
            assert testing.prefetch_window(off) == prefetch == off.stats().prefetch_window_bytes
            if prefetch == 0:
                assert all(r.state.value != "loaded" for r in off.records())
            loss.backward()
    finally:
        off.close()
