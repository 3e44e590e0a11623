"""ssdtrain: offload activations to SSD during training, exactly.

Example::

    import ssdtrain
    off = ssdtrain.Offloader(ssdtrain.OffloadConfig(spill_dir="/nvme/ssdtrain"))
    for batch in data:
        with off:                  # tensors autograd saves here go to the SSD
            loss = model(batch)
        loss.backward()            # and come back, prefetched, bit-identical
    print(off.stats().summary())
    off.close()
"""

from ._config import OffloadConfig, ResolvedConfig
from ._errors import (ConfigError, InplaceModificationError, IntegrityError,
                      OffloaderClosedError, SpillIOError, SSDTrainError)
from ._errors import __all__ as _ERROR_NAMES
from .api import Offloader, RecordView, Stats, keep_in_memory, offload

__all__ = ["Offloader", "OffloadConfig", "RecordView", "ResolvedConfig", "Stats", "keep_in_memory",
           "offload", *_ERROR_NAMES]

__version__ = "0.1.0"
