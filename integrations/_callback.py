"""What the training-loop callbacks (Hugging Face ``hf.py``, Lightning ``lightning.py``)
share: who owns the offloader, attaching it for one fit, and the counters they log.

A callback either gets an :class:`~ssdtrain.Offloader` (the caller owns it and it
stays open) or creates one when fitting starts from a config and field overrides (it
owns it and closes it when fitting ends).
"""

from __future__ import annotations

import logging

import ssdtrain

log = logging.getLogger("ssdtrain")
_MIB = 1 << 20


class FitAttachment:
    """The offloader of one callback, attached to one module per fit."""

    def __init__(self, offloader, config, overrides, *, name="SSDTrainCallback"):
        if offloader is not None and (config is not None or overrides):
            raise ssdtrain.ConfigError(f"ssdtrain: {name} got an offloader and config fields; "
                                       f"configure the offloader you pass, or pass only the "
                                       f"fields.")
        self.offloader = offloader
        self.owned = offloader is None
        self._config, self._overrides = config, overrides
        self.module = None  # attached now

    def start(self, module):
        """Attach to ``module``, creating the offloader first when the callback owns it and
        has none open."""
        if self.offloader is None or (self.owned and self.offloader.closed):
            self.offloader = ssdtrain.Offloader(self._config, **self._overrides)
        self.offloader.attach(module)
        self.module = module
        log.info("ssdtrain: attached to %s (%r)", type(module).__name__, self.offloader)

    @property
    def open(self):
        return self.offloader is not None and not self.offloader.closed

    def finish(self):
        """Detach, log the summary, and close the offloader if the callback owns it.
        Does nothing when nothing is attached (it may be called twice)."""
        if self.module is None:
            return
        self.offloader.detach(self.module)
        self.module = None
        log.info("ssdtrain: %s", self.offloader.stats().summary())
        if self.owned:
            self.offloader.close()


def metrics(s: ssdtrain.Stats) -> dict:
    """The counters both callbacks log (cumulative), from a :class:`~ssdtrain.Stats`."""
    return {"ssdtrain/offloaded_mib": s.offloaded_bytes / _MIB,
            "ssdtrain/read_mib": s.bytes_read / _MIB,
            "ssdtrain/peak_resident_mib": s.peak_resident_bytes / _MIB,
            "ssdtrain/prefetch_misses": float(s.prefetch_misses),
            "ssdtrain/stall_s": s.stall_seconds + s.write_stall_seconds}
