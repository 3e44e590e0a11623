"""The ssdtrain error family.

Every error ssdtrain raises derives from :class:`SSDTrainError`, itself a
``RuntimeError`` so code that already catches autograd's errors keeps working.
Messages start with ``ssdtrain:``, say what happened and what was expected,
and end with what to do.
"""

__all__ = [
    "SSDTrainError",
    "ConfigError",
    "SpillIOError",
    "IntegrityError",
    "OffloaderClosedError",
    "InplaceModificationError",
]


class SSDTrainError(RuntimeError):
    """Base class of every error raised by ssdtrain."""


class ConfigError(SSDTrainError, ValueError):
    """An :class:`~ssdtrain.OffloadConfig` field (named in the message) is invalid."""


class SpillIOError(SSDTrainError, OSError):
    """Reading or writing the spill tier failed; carries ``errno`` and ``filename``."""

    def __init__(self, message, errno=None, filename=None):
        SSDTrainError.__init__(self, message)
        self.errno = errno
        self.filename = filename
        self.strerror = message

    def __str__(self):
        return self.strerror


class IntegrityError(SSDTrainError):
    """Data read back from the spill tier is not what was written."""


class OffloaderClosedError(SSDTrainError):
    """A saved tensor was unpacked after its :class:`~ssdtrain.Offloader` was closed."""


class InplaceModificationError(SSDTrainError):
    """A tensor saved for backward was modified in place after it was saved.

    Autograd raises the same complaint without hooks; with saved-tensor hooks
    installed it no longer checks, so ssdtrain does (NOTE [ In-place checks ] in
    docs/ARCHITECTURE.md says where, and what cannot be detected).
    """
