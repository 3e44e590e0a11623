"""NOTE [ Hooks off past the window ] (ssdtrain/_policies/auto.py): under ``policy="auto"``, once
a step's quota is spent and ``prefetch_bytes`` more were passed through, the hooks come
off for the rest of forward. Searched for counterexamples: the trained model (loss,
gradients, parameters after an optimizer step, BatchNorm statistics) equals a run
without ssdtrain on every model of the suite at any quota and window; the hooks come
off only where the NOTE says (a quota, no plan, nothing below ours, our pair on top);
the saves after the cut never reach ssdtrain; the step's saved bytes are the last full
count, and a full step comes after ``RECOUNT_STEPS`` cut ones."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import testing
from ssdtrain._policies import auto as _auto
from ssdtrain.tools import pin_auto_quota, set_hooks_cut
from models import ALL_MODELS

KiB = 1 << 10


def _train(model, inputs, off, steps, lr=0.05):
    """``steps`` SGD steps on a copy of ``model`` (under ``off`` when given): the copy,
    and per step the loss and gradients."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if off is None:
            loss = model(*inputs)
        else:
            with off:
                loss = model(*inputs)
        loss.backward()
        out.append((loss.detach().clone(),
                    {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
    return model, out


def _assert_same_model(ref, got):
    (m_ref, steps_ref), (m_got, steps_got) = ref, got
    for i, ((l0, g0), (l1, g1)) in enumerate(zip(steps_ref, steps_got)):
        assert torch.equal(l0, l1), f"loss of step {i}"
        for name in g0:
            assert torch.equal(g0[name], g1[name]), f"gradient of {name} in step {i}"
    for (name, a), (_, b) in zip(m_ref.state_dict().items(), m_got.state_dict().items()):
        assert torch.equal(a, b), f"state_dict[{name}] after training"


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, build in ALL_MODELS.items():
        torch.manual_seed(0)
        model, inputs = build(torch.float32)
        out[name] = (model, inputs, _train(model, inputs, None, 4))
    return out


def _offloader(tmp_path, prefetch, **kw):
    return ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=str(tmp_path), policy="auto", min_tensor_bytes=1 * KiB,
        prefetch_bytes=prefetch, **kw))


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(ALL_MODELS)), share=st.floats(0.0, 1.0),
       prefetch=st.sampled_from([1, 4 * KiB, 64 * KiB, 1 << 20]))
def test_cut_steps_train_the_same_model(references, tmp_path_factory, name, share, prefetch):
    """Any quota (a share of the step's bytes) and window, on every model: four
    trained steps equal the run without ssdtrain (parameters, buffers, every loss and
    gradient); when the quota leaves more than the window past it, steps were cut."""
    model, inputs, ref = references[name]
    off = _offloader(tmp_path_factory.mktemp("cut"), prefetch)
    try:
        with off:  # one step counts what the model saves (a copy: BatchNorm updates)
            copy.deepcopy(model)(*inputs)
        saved = off.stats().unique_bytes
        off.wait()
        off.close()
        off = _offloader(tmp_path_factory.mktemp("cut"), prefetch)
        pin_auto_quota(off, int(share * saved))
        got = _train(model, inputs, off, 4)
        _assert_same_model(ref, got)
        st_ = off.stats()
        assert st_.hooks_cut_steps <= 3  # never the first step: nothing counted yet
        if share < 0.5 and saved - share * saved > 2 * prefetch + 64 * KiB:
            assert st_.hooks_cut_steps == 3, (st_.hooks_cut_steps, saved, share, prefetch)
    finally:
        off.close()


def _count_packs(off):
    """Wrap the store's pack hook (before entering: the pushed pair is the wrapper):
    the list of bytes of each call."""
    calls = []

    def spying(pack):
        def spy(t):
            calls.append(t.numel() * t.element_size())
            return pack(t)
        return spy
    testing.wrap_hooks(off, pack=spying)
    return calls


def test_saves_after_the_cut_never_reach_ssdtrain(tmp_path, references):
    """A cut step calls the pack hook for the quota's saves and the window's past it,
    then never again in that forward; a full step calls it for every save."""
    model, inputs, _ = references["gpt"]
    off = _offloader(tmp_path, 16 * KiB)
    pin_auto_quota(off, 32 * KiB)
    calls = _count_packs(off)
    try:
        per_step = []
        for _ in range(3):
            calls.clear()
            with off:
                loss = model(*inputs)
            loss.backward()
            per_step.append(len(calls))
        assert off.stats().hooks_cut_steps == 2
        assert per_step[1] == per_step[2] < per_step[0] / 2, per_step
    finally:
        off.close()


def test_saved_bytes_come_from_the_last_full_step_and_a_full_step_recounts(tmp_path,
                                                                          references):
    """A cut step leaves the controller's S as the last full step's; after
    ``RECOUNT_STEPS`` cut steps in a row one step runs its hooks to the end."""
    model, inputs, _ = references["mlp"]
    off = _offloader(tmp_path, 1)
    pin_auto_quota(off, 0)
    calls = _count_packs(off)
    try:
        cut, counts, saved = [], [], []
        for _ in range(_auto.RECOUNT_STEPS + 3):
            before = off.stats().hooks_cut_steps
            calls.clear()
            with off:
                loss = model(*inputs)
            loss.backward()
            cut.append(off.stats().hooks_cut_steps - before)
            counts.append(len(calls))
            saved.append(off._auto._saved)
        n = _auto.RECOUNT_STEPS
        assert cut == [0] + [1] * n + [0, 1], cut
        assert counts[0] == counts[n + 1] > counts[1], counts
        assert len(set(saved[1:])) == 1 and saved[1] > 0  # the full count, kept
    finally:
        off.close()


def test_no_cut_with_another_pair_below(tmp_path, references):
    """Under an outer pair of saved-tensor hooks (``save_on_cpu`` around the step) ours
    shadow it for the whole forward: the outer pair gets nothing, no step is cut."""
    model, inputs, ref = references["gpt"]
    off = _offloader(tmp_path, 1)
    pin_auto_quota(off, 0)
    outer = []

    def pack(t):
        outer.append(t.shape)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _train(model, inputs, off, 4)
    off.close()
    _assert_same_model(ref, got)
    assert outer == [] and off.stats().hooks_cut_steps == 0


def test_no_cut_with_a_plan_or_under_static(tmp_path, references):
    """``track`` (a plan needs every record) and ``policy="static"`` never cut."""
    model, inputs, ref = references["gpt"]
    off = _offloader(tmp_path, 1)
    off.track(model)
    pin_auto_quota(off, 0)
    try:
        for _ in range(3):
            with off:
                loss = model(*inputs)
            loss.backward()
        assert off.stats().hooks_cut_steps == 0
    finally:
        off.close()
    static = ssdtrain.Offloader(ssdtrain.OffloadConfig(
        spill_dir=str(tmp_path), policy="static", min_tensor_bytes=1 * KiB, prefetch_bytes=1))
    try:
        _assert_same_model(ref, _train(model, inputs, static, 4))
        assert static.stats().hooks_cut_steps == 0
    finally:
        static.close()


def test_a_pair_pushed_inside_stays_on_top(tmp_path, references):
    """A pair pushed inside the step (and left there) is on top when a later save
    crosses the window: it is not ours, so nothing is popped from under it, and once
    it is left the step goes on with ours and ends with the stack as it began."""
    model, inputs, _ = references["mlp"]
    off = _offloader(tmp_path, 1)
    pin_auto_quota(off, 0)
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        with off:
            model(*inputs).backward()
        assert top(False) is None
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with off:
            hooks.__enter__()
            off._cut()  # as the store's pack would call it: ours are not on top
            assert top(False) is not None and off.stats().hooks_cut_steps == 0
            hooks.__exit__(None, None, None)
            loss = model(*inputs)
        loss.backward()
        assert top(False) is None
    finally:
        off.close()


def test_set_hooks_cut_turns_it_off_and_checks_its_input(tmp_path, references):
    model, inputs, ref = references["gpt"]
    off = _offloader(tmp_path, 1)
    pin_auto_quota(off, 0)
    set_hooks_cut(off, False)
    try:
        _assert_same_model(ref, _train(model, inputs, off, 4))
        assert off.stats().hooks_cut_steps == 0
        with pytest.raises(ssdtrain.ConfigError, match="True or False"):
            set_hooks_cut(off, 1)
    finally:
        off.close()
    static = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir=str(tmp_path),
                                                       policy="static"))
    try:
        with pytest.raises(ssdtrain.ConfigError, match="policy='auto'"):
            set_hooks_cut(static, True)
    finally:
        static.close()


def test_an_interrupt_right_after_the_pop_never_takes_a_partial_count_for_s(
        tmp_path, references, monkeypatch):
    """A KeyboardInterrupt landing in ``Offloader._cut`` just after our hooks came off
    (before anything else is noted) leaves the step marked cut: the controller keeps
    the last full step's S rather than the part the cut step counted; the next steps
    are exact."""
    from ssdtrain._offloader import forward as _forward
    model, inputs, _ = references["mlp"]
    off = _offloader(tmp_path, 1)
    pin_auto_quota(off, 0)
    pop = _forward.ForwardState.pop_if_top
    armed = [False]

    def pop_then_interrupt(self):
        popped = pop(self)
        if armed[0] and popped:
            armed[0] = False
            raise KeyboardInterrupt
        return popped
    monkeypatch.setattr(_forward.ForwardState, "pop_if_top", pop_then_interrupt)
    try:
        with off:
            model(*inputs).backward()   # counts S in full
        with off:
            model(*inputs).backward()
        full = off._auto._saved
        assert full > 0
        armed[0] = True
        with pytest.raises(KeyboardInterrupt):
            with off:
                model(*inputs).backward()
        assert not armed[0]              # it fired
        with off:                        # begins: measures the interrupted step
            model(*inputs).backward()
        assert off._auto._saved == full
    finally:
        off.close()
