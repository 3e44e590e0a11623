"""What a forked child does with the parent's engines and stores.

NOTE [ Engines after fork ]
``os.fork()`` copies the whole address space but only the calling thread. An engine's
workers, and the requests they were running, do not exist in the child; a mutex one
of them held at the fork stays locked forever there. A child that joins those
threads (an engine's ``shutdown()``, run by ``close()`` or by a finalizer at exit)
hangs or crashes, and one that submits to them waits forever. So the objects that
own such threads register here, and in the child, right after the fork (before
``os.fork()`` returns), each one is *abandoned*: it forgets the parent's threads and
requests without joining, waiting on or freeing anything they may use, and refuses
further work. The child never touches the parent's engine; it creates its own
:class:`~ssdtrain.Offloader` if it wants to offload.

:func:`register` is cheap (a dict insert and a weak reference), so every engine and
store registers when it is made; nothing is kept alive by the registry.
"""

from __future__ import annotations

import itertools
import logging
import os
import weakref

__all__ = ["register", "unregister"]

log = logging.getLogger("ssdtrain")

# key -> (weak reference, callback). Plain dict operations are atomic under the GIL, so
# no lock: a lock held by another thread at the fork would stay locked in the child,
# and the handler below runs there.
_registry: dict = {}
_keys = itertools.count()


def register(obj, callback) -> int:
    """Call ``callback(obj)`` in every child forked while ``obj`` is alive.

    Args:
        obj: any object that supports weak references; the registry does not keep it
            alive (its entry goes when it is collected).
        callback: a function of one argument. It must not hold ``obj`` itself (a bound
            method of ``obj`` would keep it alive forever): pass ``type(obj).abandon``
            or a module-level function. It runs in the child right after the fork, on
            the thread that forked; an exception from it is logged, never raised.

    Returns:
        A key for :func:`unregister`.

    Raises:
        ValueError: ``callback`` is a bound method of ``obj``.
    """
    if getattr(callback, "__self__", None) is obj:
        raise ValueError("ssdtrain: _fork.register(obj, callback) got a bound method of obj, "
                         "which would keep obj alive forever; pass an unbound function such "
                         "as type(obj).abandon.")
    key = next(_keys)
    _registry[key] = (weakref.ref(obj, lambda _ref, key=key: _registry.pop(key, None)), callback)
    return key


def unregister(key: int) -> None:
    """Forget the registration ``key`` (from :func:`register`); unknown keys are ignored."""
    _registry.pop(key, None)


def _after_fork_in_child() -> None:
    """Abandons every live registered object, in registration order (an engine before
    the store made on it); their entries are dropped: the child owns none of them."""
    entries = list(_registry.items())
    for key, (ref, callback) in entries:
        _registry.pop(key, None)
        obj = ref()
        if obj is None:
            continue
        try:
            callback(obj)
        except BaseException:  # noqa: BLE001 - the child must go on; say what failed
            log.exception("ssdtrain: abandoning %r in a forked child failed; it may hang or "
                          "crash if used or released in this process. Please report.", obj)


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)
