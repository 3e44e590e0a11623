"""PyTorch Lightning adapter (integrations/lightning.py): a small fit is bitwise the same
with and without the callback (INV-EXACT, on the trained model: parameters, BatchNorm
buffers, the logged loss), offloads bytes, logs ssdtrain's counters through Lightning's
logger, leaves validation alone, and cleans up after a fit that raises."""

from __future__ import annotations

import csv
import logging

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch", reason="pip install ssdtrain[lightning]")

import ssdtrain  # noqa: E402
from ssdtrain.integrations.lightning import SSDTrainCallback  # noqa: E402

STEPS = 4


class Net(pl.LightningModule):
    """An MLP with BatchNorm (buffers updated in forward) and dropout (RNG), trained
    with SGD; ``fail_at`` raises inside ``training_step`` at that batch."""

    def __init__(self, fail_at=None, indirect=False):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.GELU(),
                                   nn.Dropout(0.1), nn.Linear(256, 256), nn.Tanh(),
                                   nn.Linear(256, 4))
        self.fail_at, self.indirect = fail_at, indirect
        self.val_packed = []

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise KeyboardInterrupt("planted")
        x, y = batch
        out = self.model(x) if self.indirect else self(x)
        loss = nn.functional.cross_entropy(out, y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8 * 64, 32, generator=g), torch.randint(0, 4, (8 * 64,), generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(ds, batch_size=64), torch.utils.data.DataLoader(
        ds, batch_size=128)


def _fit(tmp_path, callbacks, name, **net_args):
    pl.seed_everything(0, workers=True)
    net = Net(**net_args)
    logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name=name, version=0)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=logger,
                         callbacks=callbacks, log_every_n_steps=1, limit_val_batches=2,
                         val_check_interval=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    train, val = _data()
    trainer.fit(net, train, val)
    return net, logger


def _rows(logger):
    with open(f"{logger.log_dir}/metrics.csv") as f:
        return list(csv.DictReader(f))


def _offloader(spill_dir):
    # write_behind_bytes=0: each pack waits for the write before it, so every record but
    # a step's last is on disk when backward starts and is read back, however late the
    # I/O thread runs on a busy machine (else backward may serve them all from memory).
    return ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static",
                                                     spill_dir=str(spill_dir), min_tensor_bytes=0,
                                                     keep_tail_bytes=0, write_behind_bytes=0))


def test_fit_is_bitwise_equal_and_offloads(tmp_path, spill_dir):
    ref, ref_logger = _fit(tmp_path, [], "ref")
    off = _offloader(spill_dir)
    got, logger = _fit(tmp_path, [SSDTrainCallback(off)], "ssdtrain")
    # The trained model, buffers included (BatchNorm's running statistics and counter).
    want, have = ref.state_dict(), got.state_dict()
    assert want.keys() == have.keys()
    for k in want:
        assert torch.equal(want[k], have[k]), k
    assert have["model.1.num_batches_tracked"].item() == STEPS
    # The logged losses are the same numbers.
    losses = lambda rows: [r["train_loss"] for r in rows if r.get("train_loss")]  # noqa: E731
    assert losses(_rows(ref_logger)) == losses(_rows(logger)) and losses(_rows(logger))
    stats = off.stats()
    assert stats.offloaded_bytes > 0 and stats.bytes_read > 0, stats
    # ssdtrain's counters went through Lightning's logger, once per training batch.
    rows = [r for r in _rows(logger) if r.get("ssdtrain/offloaded_mib")]
    assert len(rows) == STEPS
    assert float(rows[-1]["ssdtrain/offloaded_mib"]) == pytest.approx(
        stats.offloaded_bytes / (1 << 20))
    assert not off.closed  # passed in: the caller owns it
    assert off.live_records() == 0
    off.close()


def test_validation_is_not_offloaded(tmp_path, spill_dir):
    """Validation runs under no_grad/inference_mode: attach leaves it alone."""
    off = _offloader(spill_dir)
    packed = []

    class Probe(pl.Callback):
        def on_validation_batch_end(self, *args, **kwargs):
            packed.append(off.stats().packed_bytes)

        def on_validation_batch_start(self, *args, **kwargs):
            packed.append(off.stats().packed_bytes)

    _fit(tmp_path, [SSDTrainCallback(off), Probe()], "val")
    assert len(packed) >= 4, "no validation batch ran"
    for start, end in zip(packed[::2], packed[1::2]):
        assert start == end, "a validation batch saved tensors through ssdtrain"
    off.close()


def test_owned_offloader_is_created_and_closed(tmp_path, spill_dir):
    cb = SSDTrainCallback(spill_dir=str(spill_dir), policy="static", min_tensor_bytes=0,
                          keep_tail_bytes=0)
    net, _ = _fit(tmp_path, [cb], "owned")
    assert cb.offloader.closed
    assert cb.offloader.stats().offloaded_bytes > 0
    # No hook is left on the module: a forward after fit saves nothing through ssdtrain.
    assert not net._forward_pre_hooks and not net._forward_hooks


def test_a_fit_that_raises_leaves_nothing_behind(tmp_path, spill_dir):
    """Lightning calls on_exception, not teardown, when fit raises (here a
    KeyboardInterrupt inside training_step, which Lightning turns into SystemExit)."""
    cb = SSDTrainCallback(spill_dir=str(spill_dir), min_tensor_bytes=0, keep_tail_bytes=0)
    with pytest.raises((SystemExit, KeyboardInterrupt)):
        _fit(tmp_path, [cb], "raises", fail_at=2)
    assert cb.offloader.closed
    assert cb._fit.module is None  # detached


def test_submodule_and_a_warning_when_nothing_is_saved(tmp_path, spill_dir, caplog):
    """training_step calls self.model(...), not self(...): attached to the
    LightningModule, nothing goes through ssdtrain and the callback says so; with
    module='model' it offloads."""
    off = _offloader(spill_dir)
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        _fit(tmp_path, [SSDTrainCallback(off, log_stats=False)], "indirect", indirect=True)
    assert "module='<attribute>'" in caplog.text
    assert off.stats().packed_bytes == 0
    off.close()
    off = _offloader(spill_dir)
    _fit(tmp_path, [SSDTrainCallback(off, module="model")], "submodule", indirect=True)
    assert off.stats().offloaded_bytes > 0
    off.close()


def test_bad_arguments_are_config_errors(spill_dir):
    off = _offloader(spill_dir)
    with pytest.raises(ssdtrain.ConfigError, match="an offloader and config"):
        SSDTrainCallback(off, min_tensor_bytes=0)
    cb = SSDTrainCallback(off, module="nope.deeper")
    with pytest.raises(ssdtrain.ConfigError, match="has no submodule"):
        cb.setup(None, Net(), "fit")
    cb = SSDTrainCallback(off, module="fail_at")
    net = Net(fail_at=3)
    with pytest.raises(ssdtrain.ConfigError, match="not a torch.nn.Module"):
        cb.setup(None, net, "fit")
    off.close()
