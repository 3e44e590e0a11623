"""Recompute changes only time (INV-EXACT): the trained model, not only the gradients.

Layers with state updated in forward (running statistics, counters) run forward
twice when recomputed. After a few optimizer steps under every plan (the static
rules, ``set_plan`` mixes with ``recompute``, ``policy="adaptive"`` with its
recompute-all profile step), the whole ``state_dict`` (parameters and buffers),
the CPU RNG state (dropout draws from it) and the eval-mode outputs must equal a
run without ssdtrain, with ``torch.equal`` (NOTE [ Recompute without a second
update ] in ssdtrain/_policies/adaptive.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssdtrain._policies.planner import KEEP, OFFLOAD, RECOMPUTE

KiB = 1 << 10
MiB = 1 << 20
SMALL = dict(min_tensor_bytes=1 * KiB, keep_tail_bytes=0, prefetch_bytes=4 * MiB)
STEPS = 4
C = 8


@pytest.fixture(autouse=True)
def _one_compute_thread():
    """Tiny ops: intra-op threads only wait for each other on a shared 2-core box
    (60 ms per batch norm under load, 1 ms without)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CountCalls(nn.Module):
    """Increments a buffer in every training forward and scales by a value that
    depends on it: a second update would change both the buffer and the output."""

    def __init__(self, c):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(c))

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.ema.mul_(0.5).add_(x.detach().mean(dim=(0, 2)), alpha=0.5)
        return x * (1.0 + 1.0 / (1.0 + self.calls.to(x.dtype)))


def _norm(kind):
    """``(module, spatial dims)`` for one kind of layer with running statistics."""
    return {
        "bn1d": lambda: (nn.BatchNorm1d(C), 1),
        "bn1d-cumulative": lambda: (nn.BatchNorm1d(C, momentum=None), 1),
        "bn2d": lambda: (nn.BatchNorm2d(C), 2),
        "bn3d": lambda: (nn.BatchNorm3d(C), 3),
        "syncbn": lambda: (nn.SyncBatchNorm(C), 2),  # one rank: no process group
        "in1d": lambda: (nn.InstanceNorm1d(C, affine=True, track_running_stats=True), 1),
        "in2d": lambda: (nn.InstanceNorm2d(C, affine=True, track_running_stats=True), 2),
        "counter": lambda: (CountCalls(C), 1),
    }[kind]()


KINDS = ["bn1d", "bn1d-cumulative", "bn2d", "bn3d", "syncbn", "in1d", "in2d", "counter"]


class Block(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.norm, _ = _norm(kind)
        self.mix = nn.Linear(C, C)  # over channels (a 1x1 convolution, cheaper on CPU)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        x = self.mix(x.movedim(1, -1)).movedim(-1, 1)
        return torch.relu(self.drop(self.norm(x)))


class Net(nn.Module):
    def __init__(self, kind, n=3, stem=True):
        super().__init__()
        self.dims = _norm(kind)[1]
        # With a stem, the first block's input requires grad; without, it is the raw batch.
        self.stem = nn.Parameter(torch.ones(C, *[1] * self.dims)) if stem else None
        self.blocks = nn.ModuleList([Block(kind) for _ in range(n)])

    def features(self, x):
        if self.stem is not None:
            x = x * self.stem
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        return self.features(x).square().mean()


def _batch(dims, seed):
    shape = (4, C) + {1: (64,), 2: (8, 8), 3: (4, 4, 4)}[dims]
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def train(kind, offloader=None, setup=None, steps=STEPS, stem=True):
    """``steps`` SGD steps from the same start; returns (state_dict, rng state, eval out)."""
    torch.manual_seed(0)
    model = Net(kind, stem=stem)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if offloader is not None:
        offloader.track(model)
        if setup is not None:
            setup(offloader)
    torch.manual_seed(1)
    for step in range(steps):
        x = _batch(model.dims, step)
        if offloader is not None:
            with offloader:
                loss = model(x)
        else:
            loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    rng = torch.get_rng_state()
    model.eval()
    with torch.no_grad():
        out = model.features(_batch(model.dims, 99))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, rng, out


def assert_same_model(ref, got):
    (ref_state, ref_rng, ref_out), (state, rng, out) = ref, got
    assert state.keys() == ref_state.keys()
    differ = [k for k in ref_state if not torch.equal(state[k], ref_state[k])]
    assert not differ, f"state_dict entries differ from the run without ssdtrain: {differ}"
    assert torch.equal(rng, ref_rng), "the CPU RNG state differs"
    assert torch.equal(out, ref_out), "eval outputs differ"


def _skip_probe(off):
    """The engine's bandwidth, as if probed: the probe (a 64 MiB write and read) is not
    what these tests are about, and costs a second per run."""
    off._layers.bandwidth = (1e9, 1e9)


PLANS = {
    "static": None,
    "rrr": (RECOMPUTE, RECOMPUTE, RECOMPUTE),
    "rok": (RECOMPUTE, OFFLOAD, KEEP),
    "kro": (KEEP, RECOMPUTE, OFFLOAD),
}


@pytest.mark.parametrize("plan", list(PLANS) + ["adaptive"])
@pytest.mark.parametrize("kind", KINDS)
def test_trained_model_equals_the_run_without_ssdtrain(make_offloader, kind, plan):
    ref = train(kind)
    if plan == "adaptive":
        # Step 1 profiled under the static rules, step 2 with every layer recomputed,
        # steps 3-4 under the plan made from them.
        off = make_offloader(policy="adaptive", memory_budget_bytes=1 << 40, profile_steps=1,
                             **SMALL)
        got = train(kind, off, _skip_probe)
        assert off._layers.plan is not None and len(off._layers.profiler.profiled_rc) == 1
    else:
        off = make_offloader(**SMALL)
        choices = PLANS[plan]
        got = train(kind, off, None if choices is None else (lambda o: o.set_plan(choices)))
    assert_same_model(ref, got)


@pytest.mark.parametrize("kind", ["bn2d", "counter"])
def test_recompute_twice_with_retain_graph_updates_once(make_offloader, kind):
    """A second backward over the same graph (retain_graph=True) recomputes again; the
    buffers still see exactly one update per forward, and both backwards agree."""
    torch.manual_seed(0)
    model = Net(kind)
    ref = Net(kind)
    ref.load_state_dict(model.state_dict())
    off = make_offloader(**SMALL).track(model)
    off.set_plan([RECOMPUTE] * 3)
    x = _batch(model.dims, 0)
    torch.manual_seed(5)
    loss_ref = ref(x)
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    torch.manual_seed(5)
    with off:
        loss = model(x)
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.equal(loss, loss_ref)
    for (k, v), (_, w) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, w), k
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_plan_table_names_layers_that_update_state(make_offloader):
    """The plan table says which layers update buffers in forward and what a
    recompute does about it."""
    torch.manual_seed(0)
    model = Net("bn2d")
    off = make_offloader(profile_steps=1, **SMALL).track(model)
    for step in range(2):
        with off:
            loss = model(_batch(2, step))
        loss.backward()
    p = off.set_plan([RECOMPUTE, KEEP, OFFLOAD])
    assert [layer.updates for layer in p.layers] == \
        [("norm.running_mean", "norm.running_var", "norm.num_batches_tracked")] * 3
    table = str(p)
    assert "blocks.0 updates buffers in forward (norm.running_mean, norm.running_var, " \
        "norm.num_batches_tracked): recomputed on copies of them" in table
    assert "blocks.1 updates buffers in forward" in table and "not recomputed" in table
