"""The DeepSpeed adapter on the real engine (CPU accelerator, gloo, world size 1).

Per ZeRO stage 0-3: the losses and every gradient of an engine made by
``ssdtrain.integrations.deepspeed.initialize`` with an ``"ssdtrain"`` section are
``torch.equal`` to those of ``deepspeed.initialize`` without it, activations were
really written, and no parameter byte was (ZeRO-3 gathers parameters into new
storage after ssdtrain's own parameter hook has run). DeepSpeed's activation
checkpointing (both variants): the checkpointed layers' inputs are offloaded and
restored before the recompute. The section's validation, file and ``args`` configs,
closing, and the example script.

DeepSpeed JIT-compiles C++ ops on first use (minutes). These tests never do:
:func:`deepspeed_cpu` disables the one op the CPU communication backend would build
(a shared-memory all-reduce used for inference) and makes any other JIT build fail
loudly; optimizers are torch's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed picks an accelerator

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

deepspeed = pytest.importorskip("deepspeed")

import ssdtrain  # noqa: E402
from ssdtrain import testing
from helpers import free_port  # noqa: E402
from ssdtrain.integrations import deepspeed as ssd_deepspeed  # noqa: E402
from ssdtrain.integrations.distributed import rank_subdir_name  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
KiB = 1 << 10
STEPS = 3
SECTION = {"policy": "static", "min_tensor_bytes": 4 * KiB, "keep_tail_bytes": 0}


# ------------------------------------------------------------------ set-up

@contextlib.contextmanager
def deepspeed_cpu():
    """DeepSpeed on the CPU accelerator with no JIT op builds; undone on exit.

    ``TorchBackend`` (DeepSpeed's communication backend) loads the
    ``deepspeed_shm_comm`` op when the CPU accelerator reports it compatible, which
    compiles it on first use; it only serves CPU inference all-reduces. Marking it
    incompatible skips it. Any other JIT build raises instead of compiling. ZeRO-3
    replaces ``torch.nn.functional.linear`` process-wide; it is put back.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    if get_accelerator()._name != "cpu":
        pytest.skip("DeepSpeed already chose a non-CPU accelerator in this process; run "
                    "these tests with DS_ACCELERATOR=cpu")

    def no_jit(builder, *args, **kwargs):
        raise AssertionError(f"test would JIT-build DeepSpeed op {builder.name} (minutes); "
                             f"avoid the feature that needs it")

    linear = F.linear
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
        mp.setattr(OpBuilder, "jit_load", no_jit)
        try:
            yield
        finally:
            torch.nn.functional.linear = linear


@pytest.fixture(scope="module")
def ds_world():
    """torch.distributed (gloo, world size 1) and DeepSpeed on the CPU, for the module."""
    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as mp, deepspeed_cpu():
        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
            mp.setenv(key, value)
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo", rank=0, world_size=1)
        assert dist.get_world_size() == 1
        try:
            yield
        finally:
            if created:
                dist.destroy_process_group()


# ------------------------------------------------------------------- model

class Proj(nn.Module):
    """A bias-free linear layer written as ``x @ w.t()`` (as attention code often is): it
    saves the transposed weight, a view of the parameter's storage, for backward."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * d_in ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = Proj(d, 4 * d)
        self.down = Proj(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Net(nn.Module):
    """Embedding, blocks, a separate head; ``forward(idx, targets)`` returns the loss.

    ``ckpt``: ``None``, ``"reentrant"`` (``deepspeed.checkpointing.checkpoint``) or
    ``"non_reentrant"`` (``deepspeed.checkpointing.non_reentrant_checkpoint``) per block,
    looked up at call time as user code does.
    """

    VOCAB, D, SEQ, BATCH, LAYERS = 256, 64, 32, 4, 3
    ACT_BYTES = BATCH * SEQ * D * 4  # one block input, fp32

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.embed = nn.Embedding(self.VOCAB, self.D)
        self.blocks = nn.ModuleList([Block(self.D) for _ in range(self.LAYERS)])
        self.head = Proj(self.D, self.VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            if self.ckpt == "reentrant":
                x = deepspeed.checkpointing.checkpoint(block, x)
            elif self.ckpt == "non_reentrant":
                x = deepspeed.checkpointing.non_reentrant_checkpoint(block, x)
            else:
                x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def make_model(ckpt=None) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return Net(ckpt).train()


def batches(n=STEPS):
    g = torch.Generator().manual_seed(4321)
    return [(torch.randint(Net.VOCAB, (Net.BATCH, Net.SEQ), generator=g),
             torch.randint(Net.VOCAB, (Net.BATCH, Net.SEQ), generator=g)) for _ in range(n)]


def ds_config(stage: int, section=None) -> dict:
    config = {"train_batch_size": Net.BATCH,
              # all parameters partitioned under ZeRO-3, however small
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if section is not None:
        config["ssdtrain"] = section
    return config


def make_engine(model, config=None, init=None, **kwargs):
    init = init or ssd_deepspeed.initialize
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer, _, _ = init(model=model, optimizer=opt, config=config, **kwargs)
    return engine


class ParamWrites:
    """Counts writes of ``offloader`` whose source bytes lie in a parameter's storage.

    Parameter storages are recorded right before each module's forward, i.e. after
    DeepSpeed's ZeRO-3 hooks gathered them (these hooks are registered after the
    engine's), and kept alive, so their memory is not reused while the test runs
    (ZeRO-3 frees a gathered buffer after the module). Each write is checked against
    the storages recorded before it was submitted.
    """

    def __init__(self, model, offloader):
        self.ranges = []
        self.writes = 0
        self.param_writes = []
        self._alive = []
        self._handles = [m.register_forward_pre_hook(self._record) for m in model.modules()]
        engine = testing.engine(offloader)
        write = engine.write

        def checked_write(file, offset, address, nbytes, **kw):
            self.writes += 1
            self.param_writes += [(address, nbytes) for lo, size in self.ranges
                                  if lo < address + nbytes and address < lo + size]
            return write(file, offset, address, nbytes, **kw)

        engine.write = checked_write

    def _record(self, module, args):
        for p in module._parameters.values():
            s = p.untyped_storage()
            if s.nbytes():
                self.ranges.append((s.data_ptr(), s.nbytes()))
                self._alive.append(s)

    def remove(self):
        for h in self._handles:
            h.remove()
        self._alive = []


def train(engine, data):
    """Forward, backward, step per batch; ``[(loss, [full grad per parameter])]``."""
    from deepspeed.utils import safe_get_full_grad

    out = []
    for idx, targets in data:
        loss = engine(idx, targets)
        engine.backward(loss)
        grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
        assert all(g is not None for g in grads)
        out.append((loss.detach().clone(), [g.clone() for g in grads]))
        engine.step()
    return out


def assert_equal_runs(ref, got):
    assert len(ref) == len(got)
    for step, ((ref_loss, ref_grads), (loss, grads)) in enumerate(zip(ref, got)):
        assert torch.equal(loss, ref_loss), f"step {step}: loss {loss} != {ref_loss}"
        for i, (a, b) in enumerate(zip(ref_grads, grads)):
            assert torch.equal(a, b), f"step {step}: gradient of parameter {i} differs"


@pytest.fixture(scope="module")
def plain_offloaded_bytes(ds_world, tmp_path_factory):
    """Bytes ssdtrain writes for :class:`Net` without DeepSpeed: the activations only."""
    spill = tmp_path_factory.mktemp("plain-spill")
    model = make_model()
    off = ssdtrain.Offloader(spill_dir=str(spill), **SECTION)
    for idx, targets in batches():
        with off:
            loss = model(idx, targets)
        loss.backward()
    off.wait()
    n = off.stats().offloaded_bytes
    off.close()
    assert n > 0
    return n


# ------------------------------------------------------------------- tests

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_equal_to_deepspeed_alone(stage, ds_world, spill_dir, plain_offloaded_bytes):
    data = batches()
    ref_engine = make_engine(make_model(), ds_config(stage), init=deepspeed.initialize)
    ref = train(ref_engine, data)
    ref_engine.destroy()

    model = make_model()
    engine = make_engine(model, ds_config(stage, dict(SECTION, spill_dir=str(spill_dir))))
    off = engine.ssdtrain
    assert isinstance(off, ssdtrain.Offloader)
    assert "ssdtrain" not in engine.config  # DeepSpeed never saw the section
    assert off.config.spill_dir == [str(spill_dir / rank_subdir_name(socket.gethostname(), 0, 0))]
    params = ParamWrites(model, off)
    # Settle every write before forward ends, so backward must read each record back
    # (a write still in flight at the end of forward is served from memory).
    settle = model.register_forward_hook(lambda module, args, out: off.wait())
    got = train(engine, data)
    settle.remove()
    params.remove()
    off.wait()
    stats = off.stats()

    assert_equal_runs(ref, got)
    assert stats.offloaded_bytes > 0 and stats.bytes_read >= stats.offloaded_bytes
    # Every activation and nothing else: what ssdtrain writes for the model without
    # DeepSpeed, and no write from a (gathered) parameter's storage.
    assert stats.offloaded_bytes == plain_offloaded_bytes
    assert params.ranges and params.writes and not params.param_writes
    engine.destroy()
    assert off.closed


def test_zero3_gathered_parameters_need_the_adapter_hook(ds_world, spill_dir, monkeypatch):
    """Without the adapter's hook behind ZeRO-3's, gathered weights would be offloaded:
    the check of the test above is not vacuous."""
    monkeypatch.setattr(ssd_deepspeed._GatheredParams, "_pre_forward", lambda *args: None)
    model = make_model()
    engine = make_engine(model, ds_config(3, dict(SECTION, spill_dir=str(spill_dir))))
    params = ParamWrites(model, engine.ssdtrain)
    train(engine, batches(1))
    params.remove()
    assert params.param_writes
    engine.destroy()


@pytest.mark.parametrize("ckpt", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_offloads_layer_inputs(ckpt, ds_world, spill_dir):
    """deepspeed.checkpointing: the region is recomputed; its input (one per block) is
    offloaded by the adapter and restored before the recompute."""
    data = batches()
    ref_engine = make_engine(make_model(ckpt), ds_config(0), init=deepspeed.initialize)
    ref = train(ref_engine, data)
    ref_engine.destroy()

    results = {}
    for inputs in (True, False):
        section = dict(SECTION, spill_dir=str(spill_dir), checkpoint_inputs=inputs)
        engine = make_engine(make_model(ckpt), ds_config(0, section))
        got = train(engine, data)
        engine.ssdtrain.wait()
        results[inputs] = engine.ssdtrain.stats()
        assert_equal_runs(ref, got)
        engine.destroy()

    on, off = results[True], results[False]
    assert off.offloaded_bytes > 0  # the head's input and logits, outside any region
    # Exactly the blocks' inputs on top, every step.
    assert on.offloaded_bytes - off.offloaded_bytes == STEPS * Net.LAYERS * Net.ACT_BYTES


def stashed_inputs(loss):
    """The inputs DeepSpeed's reentrant checkpoints of ``loss``'s graph stashed."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        found += getattr(node, "deepspeed_saved_tensors", None) or []
        todo += [n for n, _ in node.next_functions]
    return found


def test_checkpoint_inputs_leave_memory_until_backward(ds_world, spill_dir):
    """Between forward and backward, what DeepSpeed's checkpoints hold is empty: the
    blocks' input bytes are in ssdtrain's records, not in memory."""
    section = dict(SECTION, spill_dir=str(spill_dir))
    engine = make_engine(make_model("reentrant"), ds_config(0, section))
    idx, targets = batches(1)[0]
    loss = engine(idx, targets)
    engine.ssdtrain.wait()
    stashed = stashed_inputs(loss)
    assert len(stashed) == Net.LAYERS
    assert all(t.numel() == 0 and t.saved_data is not None for t in stashed)
    assert engine.ssdtrain.stats().offloaded_bytes >= Net.LAYERS * Net.ACT_BYTES
    engine.backward(loss)
    assert all(t.saved_data is None for t in stashed)  # restored once, then let go
    engine.destroy()


def test_checkpoint_inputs_with_zero3(ds_world, spill_dir):
    data = batches()
    ref_engine = make_engine(make_model("reentrant"), ds_config(3), init=deepspeed.initialize)
    ref = train(ref_engine, data)
    ref_engine.destroy()
    engine = make_engine(make_model("reentrant"),
                         ds_config(3, dict(SECTION, spill_dir=str(spill_dir))))
    got = train(engine, data)
    engine.ssdtrain.wait()
    assert_equal_runs(ref, got)
    assert engine.ssdtrain.stats().offloaded_bytes >= STEPS * Net.LAYERS * Net.ACT_BYTES
    engine.destroy()


def test_checkpoint_outside_engine_is_deepspeeds(ds_world):
    """Outside an ssdtrain engine forward the adapter's checkpoint is DeepSpeed's: the
    input stays as it is and nothing is attached to it."""
    block = make_model().blocks[0]
    x = torch.randn(2, 8, Net.D, requires_grad=True)
    y = ssd_deepspeed.checkpoint(block, x * 1)
    z = ssd_deepspeed.non_reentrant_checkpoint(block, x * 1)
    (y.sum() + z.sum()).backward()
    ref = block(x).sum() * 2
    ref_grad, = torch.autograd.grad(ref, x)
    assert torch.equal(x.grad, ref_grad)


@pytest.mark.parametrize("section, match", [
    ({"spill_dirr": "/tmp"}, r"unknown key 'spill_dirr'.*valid keys are enabled, "
                             r"checkpoint_inputs, spill_dir, min_tensor_bytes"),
    ({"enabled": "yes"}, r"\"ssdtrain.enabled\".*true or false"),
    ({"prefetch_bytes": "lots"}, r"prefetch_bytes"),
    ({"spill_dir": "/nonexistent/ssdtrain"}, r"spill_dir '/nonexistent/ssdtrain'.*does not exist"),
    (["spill_dir"], r"must be a dict"),
])
def test_section_is_validated_before_deepspeed_runs(section, match, monkeypatch):
    called = []

    def fake_initialize(*args, **kwargs):
        called.append(1)

    fake_initialize.__signature__ = inspect.signature(deepspeed.initialize)
    monkeypatch.setattr(deepspeed, "initialize", fake_initialize)
    with pytest.raises(ssdtrain.ConfigError, match=match):
        ssd_deepspeed.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 1,
                                                                "ssdtrain": section})
    assert not called


def test_pipeline_model_is_refused(ds_world):
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule needs DeepSpeed's comm
    model = PipelineModule(layers=[nn.Linear(4, 4)], num_stages=1)
    with pytest.raises(ssdtrain.ConfigError, match="pipeline parallelism"):
        ssd_deepspeed.initialize(model=model, config=ds_config(0, {}))


def test_disabled_section_is_removed_and_offloads_nothing(ds_world):
    config = ds_config(0, {"enabled": False, "spill_dir": "/nonexistent"})
    engine = make_engine(make_model(), config)
    assert engine.ssdtrain is None
    assert "ssdtrain" not in engine.config
    assert config["ssdtrain"] == {"enabled": False, "spill_dir": "/nonexistent"}  # caller's dict
    train(engine, batches(1))
    engine.destroy()

    engine = make_engine(make_model(), ds_config(0))  # no section at all
    assert engine.ssdtrain is None
    engine.destroy()


def test_config_file_and_args_deepspeed_config(ds_world, spill_dir, tmp_path):
    path = tmp_path / "ds_config.json"
    text = json.dumps(ds_config(2, dict(SECTION, spill_dir=str(spill_dir))))
    path.write_text(text)
    for kwargs in ({"config": str(path)},
                   {"args": argparse.Namespace(deepspeed_config=str(path), local_rank=0)}):
        engine = make_engine(make_model(), **kwargs)
        assert isinstance(engine.ssdtrain, ssdtrain.Offloader)
        assert "ssdtrain" not in engine.config
        train(engine, batches(1))
        engine.ssdtrain.wait()
        assert engine.ssdtrain.stats().offloaded_bytes > 0
        engine.destroy()
        if "args" in kwargs:
            assert kwargs["args"].deepspeed_config == str(path)  # restored
    assert path.read_text() == text


def test_offloader_closed_when_engine_is_garbage(ds_world, spill_dir):
    engine = make_engine(make_model(), ds_config(0, dict(SECTION, spill_dir=str(spill_dir))))
    off = engine.ssdtrain
    train(engine, batches(1))
    del engine
    gc.collect()
    assert off.closed


def test_example_runs(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in
                                         env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "deepspeed_train.py"), "--tiny",
         "--spill-dir", str(tmp_path)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "losses bitwise equal to DeepSpeed alone: True" in proc.stdout, proc.stdout
    assert "step time" in proc.stdout and "activation memory" in proc.stdout, proc.stdout
    written = re.search(r"written ([0-9.]+) MiB/step", proc.stdout)
    assert written and float(written.group(1)) > 0, proc.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / rank_subdir_name(socket.gethostname(), 0, 0)]
