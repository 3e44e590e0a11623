"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2 CPU ranks (gloo) with ssdtrain attached.

Checks, on every rank, over two optimizer steps:

* the losses and the local gradient shards are bitwise equal to FSDP2 without ssdtrain;
* no *unsharded* parameter is ever offloaded. FSDP2 all-gathers a block's parameters
  before its forward and frees them (``storage.resize_(0)``) right after; Linear saves
  its weight for backward, so a wrapper that offloaded it would write memory that is
  about to be freed, for nothing. ssdtrain keeps them because the module-state tracker
  sees the unsharded parameters as each module runs (FSDP2's pre-forward hook swaps
  them in first), and ``attach`` records the top module's own parameters after FSDP2's
  root hook unsharded them (the head below is used functionally by the root).

The ranks run in a subprocess (``torch.multiprocessing.spawn``) with a timeout, so a
hang in a collective fails the test instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORLD = 2
TIMEOUT_S = 240


def test_fsdp2_two_ranks(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="needs torch.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent)] + env.get("PYTHONPATH", "").split(os.pathsep))
    proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in range(WORLD):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["mismatch"] == "", (rank, r)
        assert r["unsharded_param_packs"] > 0, r  # Linear did save unsharded weights...
        assert r["unsharded_param_offloaded"] == 0, r  # ...and none was offloaded
        assert r["offloaded_bytes"] > 0 and r["prefetch_misses"] == 0, r
        assert r["live_records"] == 0, r


# ------------------------------------------------------------- rank side
def _model():
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.up = nn.Linear(d, h)
            self.down = nn.Linear(h, d)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(x)))

    class Net(nn.Module):
        def __init__(self, d=64, h=256, depth=3):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Block(d, h) for _ in range(depth))
            self.head = nn.Parameter(torch.randn(d, d) / d ** 0.5)  # used functionally

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return F.linear(torch.tanh(x), self.head).square().mean()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def _sharded(model):
    from torch.distributed.fsdp import fully_shard
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _unsharded_storages(model):
    """Data pointers of the unsharded parameters allocated right now."""
    ptrs = set()
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fp in (group.fsdp_params if group is not None else ()):
            p = getattr(fp, "_unsharded_param", None)
            if p is not None and p.untyped_storage().nbytes() > 0:
                ptrs.add(p.untyped_storage().data_ptr())
    return ptrs


def _steps(model, x, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        out.append((loss.detach().clone(),
                    {n: p.grad.to_local().clone() for n, p in model.named_parameters()}))
        opt.step()
    return out


def _rank(rank, out_dir):
    import torch.distributed as dist

    import ssdtrain
    from ssdtrain import testing
    from ssdtrain._store.store import Handle

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=WORLD)
    try:
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(10 + rank))
        ref = _steps(_sharded(_model()), x)

        model = _sharded(_model())
        spill = Path(out_dir) / f"spill{rank}"
        spill.mkdir()
        off = ssdtrain.Offloader(policy="static",
                                 spill_dir=str(spill), min_tensor_bytes="16KiB", keep_tail_bytes=0)
        off.attach(model)  # after fully_shard: FSDP2's root pre-hook runs before ours
        counts = {"unsharded_param_packs": 0, "unsharded_param_offloaded": 0}
        def spying(pack):
            def spy(t):
                result = pack(t)
                if t.untyped_storage().data_ptr() in _unsharded_storages(model):
                    counts["unsharded_param_packs"] += 1
                    counts["unsharded_param_offloaded"] += isinstance(result, Handle)
                return result
            return spy

        testing.wrap_hooks(off, pack=spying)
        got = _steps(model, x)
        off.wait()
        mismatch = ""
        for step, ((rl, rg), (gl, gg)) in enumerate(zip(ref, got)):
            if not torch.equal(rl, gl):
                mismatch = mismatch or f"loss at step {step}"
            for name, g in rg.items():
                if not torch.equal(g, gg[name]):
                    mismatch = mismatch or f"gradient of {name} at step {step}"
        del got
        s = off.stats()
        result = dict(counts, mismatch=mismatch, offloaded_bytes=s.offloaded_bytes,
                      prefetch_misses=s.prefetch_misses, live_records=off.live_records())
        off.detach()
        off.close()
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(_rank, args=(sys.argv[1],), nprocs=WORLD, join=True)
