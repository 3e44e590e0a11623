"""PyTorch Lightning adapter: offload activations with one callback.

Lightning's ``Trainer`` owns the training loop, so no ``with offloader:`` can be put
around ``training_step``'s forward. :class:`SSDTrainCallback` attaches an
:class:`~ssdtrain.Offloader` to the ``LightningModule`` when fitting starts
(:meth:`ssdtrain.Offloader.attach`: every outermost training forward of the module,
in train mode with grad enabled, becomes one offloaded pass; validation, test and
predict run under ``no_grad``/``inference_mode`` and are left alone), logs ssdtrain's
counters through the Trainer's loggers, and detaches when fitting ends (also when
it ends with an exception: Lightning then calls ``on_exception``, not ``teardown``).

``attach`` hooks the module's ``forward``: a ``training_step`` that computes its loss
by calling ``self(...)`` (or ``self.model(...)`` on a submodule: pass ``module=`` to
attach there) is covered; one that calls other methods of the module is not, and
the callback says so after the first training batch offloaded nothing.

Example::

    from ssdtrain.integrations.lightning import SSDTrainCallback
    trainer = lightning.pytorch.Trainer(
        callbacks=[SSDTrainCallback(spill_dir="/nvme/ssdtrain")])
    trainer.fit(model, datamodule)

Logged metrics (per training batch, ``log_every_n_steps`` apply; cumulative):
``ssdtrain/offloaded_mib``, ``ssdtrain/read_mib``, ``ssdtrain/peak_resident_mib``,
``ssdtrain/prefetch_misses``, ``ssdtrain/stall_s``.

Needs ``pip install ssdtrain[lightning]`` (``lightning``; the older
``pytorch_lightning`` package is used where ``lightning`` is not installed). Tested
with lightning 2.6 (``tests/test_lightning.py``).
"""

from __future__ import annotations

import logging

import ssdtrain

try:  # the unified package first; the standalone one where only it is installed
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - exercised only without `lightning`
    from pytorch_lightning import Callback

from ._callback import FitAttachment, metrics

__all__ = ["SSDTrainCallback"]

log = logging.getLogger("ssdtrain")


class SSDTrainCallback(Callback):
    """Attaches an :class:`~ssdtrain.Offloader` to the LightningModule while it fits.

    Args:
        offloader: the offloader to attach; the callback then leaves it open at the end
            (you own it). ``None`` (default): the callback creates one from
            ``config``/``overrides`` when fitting starts and closes it when fitting ends.
        config: an :class:`~ssdtrain.OffloadConfig` for the offloader the callback
            creates; ``None`` (default) reads ``SSDTRAIN_*`` environment variables.
        module: the attribute path of the submodule whose forward to offload
            (``"model"`` for ``self.model``); ``None`` (default): the LightningModule.
        log_stats: log ``ssdtrain/*`` counters through the Trainer's loggers. Default True.
        **overrides: :class:`~ssdtrain.OffloadConfig` fields for the offloader it creates.

    Raises:
        ConfigError: ``offloader`` is given together with ``config`` or ``overrides``.
    """

    def __init__(self, offloader: ssdtrain.Offloader = None, config: ssdtrain.OffloadConfig = None,
                 *, module: str = None, log_stats: bool = True, **overrides):
        self._fit = FitAttachment(offloader, config, overrides)
        self._module_path, self._log_stats = module, log_stats
        self._checked = False

    @property
    def offloader(self) -> ssdtrain.Offloader:
        """The offloader (``None`` before the first fit when the callback creates it)."""
        return self._fit.offloader

    # ------------------------------------------------------------------ fitting
    def setup(self, trainer, pl_module, stage):
        if stage != "fit":
            return
        self._fit.start(self._target(pl_module))
        self._checked = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self._fit.open:
            return
        s = self.offloader.stats()
        if not self._checked:
            self._checked = True
            if s.packed_bytes == 0:
                log.warning("ssdtrain: the first training batch saved nothing through the "
                            "offloader: training_step does not call the forward of %s. Pass "
                            "SSDTrainCallback(module='<attribute>') naming the submodule it "
                            "calls.", type(self._fit.module).__name__)
        if self._log_stats:
            pl_module.log_dict(self.metrics(s), on_step=True, on_epoch=False, logger=True,
                               prog_bar=False, batch_size=1)

    def teardown(self, trainer, pl_module, stage):
        if stage == "fit":
            self._fit.finish()

    def on_exception(self, trainer, pl_module, exception):
        # A fit that raises (KeyboardInterrupt included) gets no teardown hooks in
        # Lightning 2.x: detach (and close what the callback owns) here.
        self._fit.finish()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def metrics(s: ssdtrain.Stats) -> dict:
        """The logged counters of a :class:`~ssdtrain.Stats` snapshot."""
        return metrics(s)

    def _target(self, pl_module):
        if self._module_path is None:
            return pl_module
        target = pl_module
        for name in self._module_path.split("."):
            target = getattr(target, name, None)
            if target is None:
                raise ssdtrain.ConfigError(
                    f"ssdtrain: SSDTrainCallback(module={self._module_path!r}): "
                    f"{type(pl_module).__name__} has no submodule at that path; name an "
                    f"attribute path of a torch.nn.Module (e.g. 'model' for self.model).")
        if not hasattr(target, "register_forward_pre_hook"):
            raise ssdtrain.ConfigError(
                f"ssdtrain: SSDTrainCallback(module={self._module_path!r}) names a "
                f"{type(target).__name__}, not a torch.nn.Module.")
        return target
