"""Multi-rank runs: per-rank spill subdirectories, the all-ranks summary, DDP and DeepSpeed.

Two spawns of 2 CPU processes each (gloo): DDP with ssdtrain against DDP without
(every gradient ``torch.equal`` on every rank, offloaded bytes > 0 on each, distinct
spill subdirectories, :func:`summarize` adds up the ranks), and DeepSpeed ZeRO-2 and
ZeRO-3 through the adapter against plain DeepSpeed (losses and gradients equal; under
ZeRO-3 no write comes from a gathered parameter). Each rank saves what it saw to a
file; the assertions run in the test process. The rest runs in this process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import socket
import stat

import pytest
import torch

import ssdtrain
from helpers import spawn_ranks
from ssdtrain.integrations.distributed import (rank_identity, rank_spill_dir, rank_subdir_name,
                                               summarize)

WORLD = 2
KiB = 1 << 10


# ------------------------------------------------------------- in-process

def test_rank_spill_dir_names_and_creates_private_subdirs(tmp_path, monkeypatch):
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    a.mkdir()
    b.mkdir()
    got = rank_spill_dir([a, str(b)], host="node 7/x", rank=9, local_rank=1)
    assert got == [str(a / "node_7_x-rank9-local1"), str(b / "node_7_x-rank9-local1")]
    for d in got:
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert rank_spill_dir(str(a), host="node 7/x", rank=9, local_rank=1) == got[0]  # reused

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "3")
    if not torch.distributed.is_initialized():
        assert rank_identity() == (socket.gethostname(), 5, 3)
        assert rank_spill_dir(a, create=False) == \
            str(a / rank_subdir_name(socket.gethostname(), 5, 3))
    # Every rank of a node, and the same ranks on another node, get their own directory.
    names = {rank_subdir_name(h, r, r % 2) for h in ("n1", "n2") for r in range(4)}
    assert len(names) == 8


def test_rank_spill_dir_refuses_bad_places(tmp_path, monkeypatch):
    with pytest.raises(ssdtrain.ConfigError, match="does not exist"):
        rank_spill_dir(tmp_path / "missing", host="h", rank=0, local_rank=0)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "h-rank0-local0")
    with pytest.raises(ssdtrain.ConfigError, match="not a directory"):
        rank_spill_dir(tmp_path, host="h", rank=0, local_rank=0)
    with pytest.raises(ssdtrain.ConfigError, match="empty list"):
        rank_spill_dir([], host="h", rank=0, local_rank=0)
    if not torch.distributed.is_initialized():
        monkeypatch.setenv("RANK", "zero")
        with pytest.raises(ssdtrain.ConfigError, match="RANK must be an integer"):
            rank_identity()


def test_summarize_without_process_group_is_the_local_stats(make_offloader):
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    off = make_offloader(min_tensor_bytes=4 * KiB, keep_tail_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = (x * 2).sin()
    y.sum().backward()
    off.wait()
    assert summarize(off) == off.stats()
    assert summarize(off).offloaded_bytes > 0


# ----------------------------------------------------------------- spawns

def _init_rank(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)


def _ddp_rank(rank, port, out_dir, spill_base):
    """One DDP rank: two steps without ssdtrain, two with; saves what it saw."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_deepspeed import batches, make_model

    _init_rank(rank, port)
    data = batches(2 + 3 * rank)[-2:]  # each rank its own batches
    result = {}
    for name in ("ref", "ssdtrain"):
        model = DDP(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        off = None
        if name == "ssdtrain":
            off = ssdtrain.Offloader(policy="static", spill_dir=rank_spill_dir(spill_base),
                                     min_tensor_bytes=4 * KiB, keep_tail_bytes=0)
        steps = []
        for idx, targets in data:
            opt.zero_grad(set_to_none=True)
            with off if off is not None else contextlib.nullcontext():
                loss = model(idx, targets)
            loss.backward()
            steps.append((loss.detach().clone(),
                          [p.grad.clone() for p in model.module.parameters()]))
            opt.step()
        result[name] = steps
        if off is not None:
            off.wait()
            result["stats"] = dataclasses.asdict(off.stats())
            result["summary"] = dataclasses.asdict(summarize(off))
            result["spill_dir"] = off.config.spill_dir
            off.close()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def _deepspeed_rank(rank, port, out_dir, spill_base):
    """One DeepSpeed rank: ZeRO-2 and ZeRO-3, each plain and through the adapter."""
    import deepspeed

    from test_deepspeed import (SECTION, ParamWrites, batches, deepspeed_cpu, ds_config,
                                make_engine, make_model, train)
    from ssdtrain.integrations import deepspeed as ssd_deepspeed

    _init_rank(rank, port)
    data = batches(2 + 3 * rank)[-2:]
    result = {}
    with deepspeed_cpu():
        for stage in (2, 3):
            config = ds_config(stage)
            config["train_batch_size"] *= WORLD
            engine = make_engine(make_model(), copy.deepcopy(config), init=deepspeed.initialize)
            result[f"ref{stage}"] = train(engine, data)
            engine.destroy()

            config["ssdtrain"] = dict(SECTION, spill_dir=spill_base)
            model = make_model()
            engine = make_engine(model, config, init=ssd_deepspeed.initialize)
            params = ParamWrites(model, engine.ssdtrain)
            result[f"ssdtrain{stage}"] = train(engine, data)
            params.remove()
            engine.ssdtrain.wait()
            result[f"stats{stage}"] = dataclasses.asdict(engine.ssdtrain.stats())
            result[f"param_writes{stage}"] = len(params.param_writes)
            result[f"param_ranges{stage}"] = len(params.ranges)
            result[f"spill_dir{stage}"] = engine.ssdtrain.config.spill_dir
            engine.destroy()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


def run_ranks(fn, tmp_path, timeout_s=300):
    """Run ``fn(rank, port, out_dir, spill_base)`` on WORLD spawned processes, each saving
    its results to ``out_dir/<rank>.pt``; returns them and ``spill_base``."""
    out_dir, spill_base = tmp_path / "out", tmp_path / "spill"
    out_dir.mkdir()
    spill_base.mkdir()
    spawn_ranks(fn, (str(out_dir), str(spill_base)), WORLD, timeout_s)
    results = [torch.load(out_dir / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    return results, spill_base


def assert_equal_steps(ref, got, where):
    assert len(ref) == len(got) > 0
    for step, ((ref_loss, ref_grads), (loss, grads)) in enumerate(zip(ref, got)):
        assert torch.equal(loss, ref_loss), f"{where} step {step}: loss {loss} != {ref_loss}"
        for i, (a, b) in enumerate(zip(ref_grads, grads)):
            assert torch.equal(a, b), f"{where} step {step}: gradient of parameter {i} differs"


def test_ddp_two_ranks(tmp_path):
    results, spill_base = run_ranks(_ddp_rank, tmp_path)
    for rank, r in enumerate(results):
        assert_equal_steps(r["ref"], r["ssdtrain"], f"rank {rank}")
        assert r["stats"]["offloaded_bytes"] > 0
        assert r["spill_dir"] == [str(spill_base / rank_subdir_name(socket.gethostname(),
                                                                     rank, rank))]
    # DDP really reduced: both ranks hold the same gradients from different batches.
    assert not torch.equal(results[0]["ref"][0][0], results[1]["ref"][0][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0]["ref"][0][1], results[1]["ref"][0][1]))
    assert results[0]["spill_dir"] != results[1]["spill_dir"]
    assert sorted(p.name for p in spill_base.iterdir()) == \
        sorted(os.path.basename(r["spill_dir"][0]) for r in results)
    # The all-ranks summary: counters summed, peaks maxed, the same on both ranks.
    summary = results[0]["summary"]
    assert summary == results[1]["summary"]
    for key in ("offloaded_bytes", "packed_bytes", "records_written", "bytes_read"):
        assert summary[key] == sum(r["stats"][key] for r in results), key
    assert summary["peak_resident_bytes"] == max(r["stats"]["peak_resident_bytes"]
                                                 for r in results)


def test_deepspeed_zero2_and_zero3_two_ranks(tmp_path):
    pytest.importorskip("deepspeed")
    results, spill_base = run_ranks(_deepspeed_rank, tmp_path)
    for rank, r in enumerate(results):
        for stage in (2, 3):
            assert_equal_steps(r[f"ref{stage}"], r[f"ssdtrain{stage}"], f"ZeRO-{stage} rank {rank}")
            assert r[f"stats{stage}"]["offloaded_bytes"] > 0
            assert r[f"param_ranges{stage}"] > 0 and r[f"param_writes{stage}"] == 0, (stage, rank)
            assert r[f"spill_dir{stage}"] == [str(spill_base / rank_subdir_name(
                socket.gethostname(), rank, rank))]
    # Same activations on both ranks' models, so the same bytes offloaded under both stages.
    for r in results:
        assert r["stats2"]["offloaded_bytes"] == r["stats3"]["offloaded_bytes"]
