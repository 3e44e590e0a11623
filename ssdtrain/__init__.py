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

import os as _os

# A source checkout used without installing it (PYTHONPATH=checkout, as `make gpu-check`
# does on a machine with no network): the adapters live in the checkout's top-level
# integrations/ folder, which an install puts at ssdtrain/integrations. Look for
# subpackages in the checkout too, so `ssdtrain.integrations` imports from there.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "integrations"))
        and _os.path.isfile(_os.path.join(_checkout, "integrations", "__init__.py"))):
    __path__.append(_checkout)

from ._config import OffloadConfig, ResolvedConfig
from ._errors import (ConfigError, InplaceModificationError, IntegrityError,
                      OffloaderClosedError, ResourceError, SpillIOError, SSDTrainError)
from ._errors import __all__ as _ERROR_NAMES
from .api import Offloader, RecordView, SavedHandle, Stats, keep_in_memory, offload

__all__ = ["Offloader", "OffloadConfig", "RecordView", "ResolvedConfig", "SavedHandle", "Stats",
           "keep_in_memory", "offload", *_ERROR_NAMES]

__version__ = "0.1.0"
