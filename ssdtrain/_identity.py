"""Storage identity and view geometry: small pure functions the tests call directly.

NOTE [ Storage identity ]
A data pointer (or a StorageImpl address) is reused as soon as its storage is
freed, so a dedup map keyed by pointer alone serves a new tensor the bytes of
an old one. ssdtrain keys records by the StorageImpl address *while holding a
weak reference to that StorageImpl* (``StorageWeakRef``): a weak reference
keeps the StorageImpl object (not its data) from being freed, so the address
cannot be handed to another storage while the key is in use. Together with the
version counter (in-place writes bump it) this makes "same key" mean "same
bytes".
"""

from typing import Tuple

import torch

try:  # the class torch itself uses to key storages (functionalization, multiprocessing)
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - very old torch
    StorageWeakRef = None

__all__ = ["StorageWeakRef", "storage_key", "byte_extent", "record_range"]


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a live storage: its StorageImpl address (see NOTE [ Storage identity ])."""
    return storage._cdata


def byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """``[start, end)`` byte range of ``t``'s storage that ``t`` can touch (``numel > 0``)."""
    item = t.element_size()
    start = t.storage_offset() * item
    if t.is_contiguous():  # the common case, in C: its span is its numel
        return start, start + t.numel() * item
    span = 1
    for size, stride in zip(t.size(), t.stride()):
        span += (size - 1) * stride
    return start, start + span * item


def record_range(extent: Tuple[int, int], storage_nbytes: int) -> Tuple[int, int]:
    """The bytes of a storage one record holds, given the first view saved from it.

    A view covering at least half of its storage records the whole storage, so
    its siblings (the other slices of a fused QKV, a transpose, the base) share
    the record. A small window into a large storage records only its own bytes:
    writing the rest would cost I/O for nothing saved.
    """
    start, end = extent
    if 2 * (end - start) >= storage_nbytes:
        return 0, storage_nbytes
    return start, end
