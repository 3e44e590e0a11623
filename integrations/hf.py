"""Hugging Face ``transformers.Trainer`` adapter: offload activations with one callback.

``Trainer`` owns the training loop, so no ``with offloader:`` can be put around its
forward passes. :class:`SSDTrainCallback` attaches an :class:`~ssdtrain.Offloader`
to the model when training begins (:meth:`ssdtrain.Offloader.attach`: every
training forward becomes one offloaded pass; evaluation and ``generate()`` run under
``no_grad`` and are left alone), adds ssdtrain's counters to the Trainer's logs, and
detaches at the end. PEFT models (LoRA...) work the same way: the frozen base
weights are parameters and are never offloaded.

Example::

    from ssdtrain.integrations.hf import SSDTrainCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SSDTrainCallback(spill_dir="/nvme/ssdtrain")])
    trainer.train()

Needs ``pip install ssdtrain[hf]``. Tested with transformers 5.23, peft 0.21 and
accelerate 1.15 (``tests/test_hf.py``).
"""

from __future__ import annotations

from transformers import TrainerCallback

import ssdtrain

from ._callback import FitAttachment, metrics

__all__ = ["SSDTrainCallback"]


class SSDTrainCallback(TrainerCallback):
    """Attaches an :class:`~ssdtrain.Offloader` to the Trainer's model while it trains.

    Args:
        offloader: the offloader to attach; the callback then leaves it open at the end
            of training (you own it). ``None`` (default): the callback creates one from
            ``config``/``overrides`` at ``on_train_begin`` and closes it at
            ``on_train_end``.
        config: an :class:`~ssdtrain.OffloadConfig` for the offloader the callback
            creates; ``None`` (default) reads ``SSDTRAIN_*`` environment variables.
        log_stats: add ``ssdtrain/*`` counters (MiB offloaded, read, peak resident,
            prefetch misses, stall seconds; cumulative) to every Trainer log. Default True.
        **overrides: :class:`~ssdtrain.OffloadConfig` fields for the offloader it creates.

    Raises:
        ConfigError: ``offloader`` is given together with ``config`` or ``overrides``.
    """

    def __init__(self, offloader: ssdtrain.Offloader = None, config: ssdtrain.OffloadConfig = None,
                 *, log_stats: bool = True, **overrides):
        self._fit = FitAttachment(offloader, config, overrides)
        self._log_stats = log_stats

    @property
    def offloader(self) -> ssdtrain.Offloader:
        """The offloader (``None`` before the first fit when the callback creates it)."""
        return self._fit.offloader

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ssdtrain.SSDTrainError("ssdtrain: SSDTrainCallback.on_train_begin got no model; "
                                         "it must be used as a transformers.Trainer callback.")
        self._fit.start(model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._log_stats or logs is None or not self._fit.open:
            return
        for k, v in metrics(self.offloader.stats()).items():
            logs[k] = round(v, 4)

    def on_train_end(self, args, state, control, **kwargs):
        self._fit.finish()
