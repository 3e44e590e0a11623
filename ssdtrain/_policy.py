"""What may be offloaded.

Parameters and buffers are never offloaded: their owner keeps them in memory
anyway, so writing them frees nothing. Autograd hands pack hooks plain tensors
(a parameter arrives as a ``Tensor``, ``weight.t()`` as a view with no
``_base``), so they are recognised by storage: while any offloader intercepts,
a global module forward pre-hook records the storages of the parameters and
buffers of every module that runs (:class:`ModuleStateTracker`).
"""

import threading

import torch

from ._identity import StorageWeakRef, storage_key

__all__ = ["ModuleStateTracker", "TRACKER", "is_offloadable_kind"]


def is_offloadable_kind(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain strided CPU or CUDA tensor ssdtrain can spill and rebuild.

    Everything else (subclasses, sparse, nested, quantized, meta, conj/neg views,
    other devices) is passed through in memory.
    """
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) \
        and t.layout == torch.strided and t.device.type in ("cpu", "cuda") \
        and not t.is_quantized and not t.is_conj() and not t.is_neg()


class ModuleStateTracker:
    """Weakly remembers the storages of parameters and buffers of modules that run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = set()  # whoever intercepts now (an Offloader's ForwardState)
        self._hook = None
        self._storages = {}  # storage key -> StorageWeakRef (pins the key, see _identity)

    def start(self, user) -> None:
        """``user`` intercepts: record module state while anyone does. Idempotent per user,
        and a start or stop cut short by an interrupt is completed by the next call
        (NOTE [ Forward phases ] in _forward.py), so a repair can always call them."""
        with self._lock:
            self._users.add(user)
            if not self._registered():
                self._prune()
                self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._pre_forward)

    def stop(self, user) -> None:
        """``user`` stopped intercepting (a user not started is ignored)."""
        with self._lock:
            self._users.discard(user)
            if not self._users and self._hook is not None:
                self._hook.remove()  # idempotent; forgotten only once removed
                self._hook = None

    def _registered(self) -> bool:
        h = self._hook
        if h is None:
            return False
        hooks = h.hooks_dict_ref()
        return hooks is not None and h.id in hooks

    def contains(self, key: int) -> bool:
        return key in self._storages

    def add(self, t) -> None:
        if t is None:
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # wrapper subclasses without storage: never offloaded anyway
        key = storage_key(s)
        if key not in self._storages:
            self._storages[key] = StorageWeakRef(s)

    def _pre_forward(self, module, args):
        for p in module._parameters.values():
            self.add(p)
        for b in module._buffers.values():
            self.add(b)

    def _prune(self):
        dead = [k for k, ref in self._storages.items() if ref.expired()]
        for k in dead:
            del self._storages[k]


TRACKER = ModuleStateTracker()
