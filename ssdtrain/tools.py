"""Building blocks for benchmarks and tools: spill files, read buffers, checksums, plans.

These are the pieces the :class:`~ssdtrain.Offloader` is built from, public so that
benchmarks (``benchmarks/io_bandwidth.py``) and examples (``examples/rok_curve.py``)
can measure them alone without reaching into private modules. Training code does not
need them. ``LoopbackDevice``/``attach_loopback`` give an Offloader a stand-in
accelerator (host memory taking the device path: benchmarks' CPU dry runs);
``MAX_BYTES`` is what "unlimited" sizes resolve to.

Example::

    from ssdtrain import tools
    spill = tools.SpillSet(["/nvme/ssdtrain"], "auto")   # anonymous O_DIRECT spill files
    print(tools.filesystem_type("/nvme/ssdtrain"), spill.files[0].direct)
    spill.close()
"""

import contextlib
import time
from typing import List, Tuple

import torch

from .io import checksum as _checksum
from ._align import BLOCK
from ._config import MAX_BYTES
from .testing.loopback import LoopbackDevice
from .testing.loopback import attach as attach_loopback
from ._policies.planner import predict, rok_plans
from .io.readbuf import ReadBuffers
from ._errors import SSDTrainError
from .io.spill import SpillFile, SpillSet, filesystem_type

__all__ = ["BLOCK", "SpillFile", "SpillSet", "ReadBuffers", "filesystem_type", "rok_plans",
           "predict", "crc32c", "crc32c_available", "uring_probe", "HookTimer",
           "LoopbackDevice", "attach_loopback", "MAX_BYTES", "set_auto_clock",
           "pin_auto_quota", "set_hooks_cut", "set_load_lead"]


def crc32c_available() -> bool:
    """Whether the compiled extension (``ssdtrain._C``) and its CRC32C are built."""
    return _checksum.available()


def crc32c(address: int, nbytes: int) -> int:
    """CRC32C of ``nbytes`` bytes at host address ``address`` (as ``verify`` computes it).

    Raises:
        ConfigError: the compiled extension is not built (see :func:`crc32c_available`).
    """
    return _checksum.crc32c(address, nbytes)


def uring_probe() -> Tuple[bool, str]:
    """Whether io_uring works here: ``(ok, reason)``, ``reason`` saying why not.

    Raises:
        ImportError: the compiled extension is not built.
    """
    from . import _C
    ok, why = _C.uring_probe()
    return bool(ok), why


# torch's own accessor for the innermost saved-tensor hooks (also used by _offloader/attach.py);
# looked up by capability, not by version.
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def set_auto_clock(offloader, clock) -> None:
    """Make ``policy="auto"`` time ``offloader``'s steps with ``clock`` (seconds, any
    origin) instead of ``time.perf_counter``. For harnesses that run several offloaders'
    steps in turn in one process (``benchmarks/accel_ab.py``): each controller measures
    a step from its forward to its next one, so the other offloaders' steps in between
    would count as its own unless its clock stops while they run.

    Raises:
        ConfigError: ``offloader`` does not run ``policy="auto"``.
    """
    from ._errors import ConfigError
    auto = getattr(offloader, "_auto", None)
    if auto is None:
        raise ConfigError(f"ssdtrain: set_auto_clock needs an Offloader with policy='auto'; "
                          f"this one runs policy={offloader.config.policy!r}.")
    auto._clock = clock


def _auto_of(offloader, tool, enabled=True):
    """The ``policy="auto"`` controller of ``offloader``, for ``tool`` (its name, for the
    message); ``enabled``: the switch given, which must be a bool.

    Raises:
        ConfigError: ``offloader`` does not run ``policy="auto"``, or ``enabled`` is not a
            bool.
    """
    from ._errors import ConfigError
    auto = getattr(offloader, "_auto", None)
    if auto is None:
        raise ConfigError(f"ssdtrain: {tool} needs an Offloader with policy='auto'; this one "
                          f"runs policy={offloader.config.policy!r}.")
    if not isinstance(enabled, bool):
        raise ConfigError(f"ssdtrain: {tool} takes True or False; got {enabled!r}.")
    return auto


def pin_auto_quota(offloader, nbytes) -> None:
    """Make ``policy="auto"`` offload ``nbytes`` per step (its earliest saved records,
    as its own quota does) from the next step on, whatever its steps measure, or choose
    again (``None``). For measurements of what one quota costs (``tools/gpu_trace.py``):
    the path a tensor takes past the quota, and the one a record takes within it, are the
    default's own.

    Raises:
        ConfigError: ``offloader`` does not run ``policy="auto"``, or ``nbytes`` is
            negative or not an integer.
    """
    from ._errors import ConfigError
    auto = _auto_of(offloader, "pin_auto_quota")
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                               or nbytes < 0):
        raise ConfigError(f"ssdtrain: pin_auto_quota takes a number of bytes >= 0 or None; "
                          f"got {nbytes!r}.")
    auto.pinned = nbytes


def set_hooks_cut(offloader, enabled: bool) -> None:
    """Let (``True``, the default) or forbid (``False``) ``policy="auto"``'s steps to
    take their hooks off once the quota and the prefetch window's bytes more are past (NOTE [
    Hooks off past the window ] in ``_policies/auto.py``), from the next step on. For
    measurements of what that saves (``benchmarks/hooks_cut.py``).

    Raises:
        ConfigError: ``offloader`` does not run ``policy="auto"``, or ``enabled`` is not
            a bool.
    """
    _auto_of(offloader, "set_hooks_cut", enabled).cuts = enabled


def set_load_lead(offloader, enabled: bool) -> None:
    """Let (``True``, the default) or forbid (``False``) ``policy="auto"``'s steps to
    widen the prefetch window so that the quota's loads arrive in time (NOTE [ Loads in
    time ] in ``_policies/auto.py``), from the next step on: with ``False`` the window is
    ``prefetch_bytes``. For measurements of what the lead buys.

    Raises:
        ConfigError: ``offloader`` does not run ``policy="auto"``, or ``enabled`` is not
            a bool.
    """
    _auto_of(offloader, "set_load_lead", enabled).leads = enabled


class HookTimer:
    """Times the saved-tensor hooks in force (an :class:`~ssdtrain.Offloader`'s, say) as
    autograd calls them, on the thread that calls them.

    Inside ``with offloader:`` (or ``offloader.intercept()``), :meth:`wrap` looks up
    the innermost pack/unpack pair autograd would call (the offloader's own hooks,
    whatever they do) and pushes a pair that calls them and records the time of each
    call (``time.perf_counter_ns`` around it, so the wrapper's own call is not
    counted). Every tensor saved inside :meth:`wrap` goes through the wrapped pack
    hook, and its unpack in backward (whenever it runs, inside or outside the block)
    through the wrapped unpack hook. What the offloader does on other threads (I/O,
    CRC, completion callbacks) is not timed; it shows only where it holds the GIL
    while a hook runs.

    Attributes:
        pack_ns: duration of each pack call in nanoseconds, in call order.
        pack_bytes: bytes of each packed tensor (``numel * element_size``).
        unpack_ns: duration of each unpack call in nanoseconds, in call order.

    Example::

        timer = HookTimer()
        with off, timer.wrap():
            loss = model(batch)
        loss.backward()
        print(sum(timer.pack_ns) / 1e6, "ms in pack,", sum(timer.unpack_ns) / 1e6, "in unpack")
    """

    def __init__(self):
        self.pack_ns: List[int] = []
        self.pack_bytes: List[int] = []
        self.unpack_ns: List[int] = []

    def clear(self) -> None:
        """Forget every recorded time."""
        self.pack_ns.clear()
        self.pack_bytes.clear()
        self.unpack_ns.clear()

    @contextlib.contextmanager
    def wrap(self):
        """Time the innermost saved-tensor hooks for the duration of the block.

        Raises:
            SSDTrainError: no saved-tensor hooks are in force (enter the offloader
                first; a step of ``policy="auto"`` with nothing to offload pushes
                none, NOTE [ The offload quota ]), or this torch cannot tell which are.
        """
        top = _top_hooks(True) if _top_hooks is not None else None
        if top is None:
            raise SSDTrainError("ssdtrain: HookTimer.wrap() found no saved-tensor hooks to time"
                                + ("" if _top_hooks is not None else
                                   " (this torch has no torch._C._autograd."
                                   "_top_saved_tensors_default_hooks)")
                                + "; enter it inside `with offloader:`. (A step of "
                                "policy='auto' with nothing to offload pushes no hooks: "
                                "Stats.offload_quota_reason then says its saved tensors are "
                                "not intercepted; policy='static' intercepts every step.)")
        pack, unpack = top
        clock = time.perf_counter_ns
        pack_ns, pack_bytes, unpack_ns = self.pack_ns, self.pack_bytes, self.unpack_ns

        def timed_pack(t):
            t0 = clock()
            packed = pack(t)
            pack_ns.append(clock() - t0)
            pack_bytes.append(t.numel() * t.element_size())
            return packed

        def timed_unpack(packed):
            t0 = clock()
            t = unpack(packed)
            unpack_ns.append(clock() - t0)
            return t

        with torch.autograd.graph.saved_tensors_hooks(timed_pack, timed_unpack):
            yield self
