"""``OffloadConfig``: every knob of an :class:`~ssdtrain.Offloader`, validated.

Environment variables (``SSDTRAIN_*``) are read in exactly one place,
:func:`OffloadConfig.from_env`; explicit keyword arguments override them.
"""

import dataclasses
import math
import os
import re
import sys
import threading
from fractions import Fraction
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from ._errors import ConfigError
from ._limits import host_memory

__all__ = ["OffloadConfig", "ResolvedConfig", "parse_bytes", "default", "default_host_budget",
           "resolve_budget", "budget_bytes", "has_ssd_tier"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

ENGINES = ("auto", "kvikio", "native", "posix")
# Engines planned but not part of this build yet; named so the error can say so.
DIRECT_IO_MODES = ("auto", "on", "off")
SPILL_ERROR_ACTIONS = ("raise", "keep")
SPILL_FULL_ACTIONS = ("keep", "raise")
POLICIES = ("auto", "static", "adaptive")

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kb": 1000, "kib": KiB,
    "m": MiB, "mb": 1000 ** 2, "mib": MiB,
    "g": GiB, "gb": 1000 ** 3, "gib": GiB,
    "t": 1 << 40, "tb": 1000 ** 4, "tib": 1 << 40,
}


# The largest byte count any field takes: a signed 64-bit offset (8 EiB). Anything
# larger is a typo, and would overflow the engines' 64-bit offsets and lengths.
MAX_BYTES = (1 << 63) - 1


def parse_bytes(value, *, name="value"):
    """Parse a byte count: an int, or a string such as ``"512MiB"``, ``"1.5 GiB"``, ``"4096"``.

    Strings are parsed exactly (``"1.5GiB"`` is 1610612736, fractions of a byte are
    dropped); the result is an ``int`` in ``[0, MAX_BYTES]``.

    Raises:
        ConfigError: naming ``name`` when the value is not a size in that range.
    """
    if isinstance(value, bool):
        raise ConfigError(f"ssdtrain: {name} must be a byte count, got the bool {value!r}; "
                          f"pass an int such as 268435456 or a string such as '256MiB'.")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            whole, _, part = m.group(1).lstrip("0").partition(".")
            # More digits than any byte count up to MAX_BYTES (19) is too large; a
            # fraction of a byte finer than 1e-30 is dropped unread (past 4300 digits
            # int() and Fraction() refuse the string with a ValueError of their own).
            if len(whole) > 24:
                raise _too_large(name, value)
            number = Fraction(f"{whole or 0}.{part[:30] or 0}")
            value = int(number * _UNITS[m.group(2).lower()])
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"ssdtrain: {name} must be >= 0 bytes, got {_show(value)}.")
        if value > MAX_BYTES:
            raise _too_large(name, value)
        return value
    raise ConfigError(f"ssdtrain: {name} must be a byte count such as 268435456 or '256MiB', "
                      f"got {_show(value)}.")


def _too_large(name, value):
    return ConfigError(f"ssdtrain: {name} is {_show(value)}, larger than any byte count "
                       f"ssdtrain can use (at most {MAX_BYTES}, 8 EiB); give a size such as "
                       f"'256MiB'.")


def _show(value):
    """``repr(value)`` for a message, shortened: an absurd value (a 400-character
    string) would drown the message, and repr() of an int beyond 4300 digits raises."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an int of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a message must not fail on an odd object's repr
        text = f"a {type(value).__name__}"
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]} ({len(text)} characters)"


def _number(value, *, name, what, minimum, maximum, allow_inf=False):
    """``value`` (an int or float, not a bool) as a ``float`` in ``(minimum, maximum]``.

    The one check of every number-valued field: refuses NaN, infinities (unless
    ``allow_inf``), ints too large for a float and values out of range, with a
    :class:`ConfigError` saying ``name`` must be ``what``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    elif isinstance(value, int):  # compared as an int: float() of a huge one overflows
        ok = minimum < value <= maximum
    else:
        ok = minimum < value <= maximum or (allow_inf and value == math.inf)
    if not ok:
        raise ConfigError(f"ssdtrain: {name} must be {what}, got {_show(value)}.")
    return float(value)


def _env_number(name, raw, *, integer=False):
    """The number an ``SSDTRAIN_*`` string spells (an int where ``integer``), for the
    field's own validation; ``"inf"`` stays infinite, but a finite spelling too large
    for a float (``"1e999"``) is refused rather than read as infinity."""
    key = f"SSDTRAIN_{name.upper()}"
    text = raw.strip()
    try:
        if integer:
            return int(text)
        value = float(text)
    except ValueError:
        if text.lstrip("+-").isdigit():  # int() refuses more than 4300 digits
            raise ConfigError(f"ssdtrain: {key} is {_show(raw)}, far out of range; give a "
                              f"value in range.") from None
        raise ConfigError(f"ssdtrain: {key} must be {'an integer' if integer else 'a number'}, "
                          f"got {_show(raw)}.") from None
    if math.isinf(value) and "inf" not in text.lower():
        raise ConfigError(f"ssdtrain: {key} is {_show(raw)}, too large for a number; "
                          f"give a value in range (or 'inf' where infinity is meant).")
    return value


@dataclass(kw_only=True, frozen=True)
class OffloadConfig:
    """Settings of an :class:`~ssdtrain.Offloader`.

    Every field is validated on construction; an invalid value raises
    :class:`~ssdtrain.ConfigError` naming the field. Byte fields accept an int
    or a string such as ``"256MiB"``. A config is frozen: :meth:`replace` makes a
    changed copy. What an :class:`~ssdtrain.Offloader` runs with is
    :meth:`resolve`'s :class:`ResolvedConfig` (NOTE [ One resolved config ]).

    Example::

        cfg = ssdtrain.OffloadConfig(spill_dir="/nvme/ssdtrain", prefetch_bytes="1GiB")
        off = ssdtrain.Offloader(cfg)
    """

    # The accepted values of the choice fields (class attributes, not fields).
    ENGINES = ENGINES                            #: values of ``engine``
    DIRECT_IO_MODES = DIRECT_IO_MODES            #: values of ``direct_io``
    SPILL_ERROR_ACTIONS = SPILL_ERROR_ACTIONS    #: values of ``on_spill_error``
    SPILL_FULL_ACTIONS = SPILL_FULL_ACTIONS      #: values of ``on_spill_full``
    POLICIES = POLICIES                          #: values of ``policy``

    spill_dir: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], None] = None
    """Directory (or list of directories) that receives spilled activations. With
    several directories, records are striped across them (one spill file each): give
    one directory per NVMe device. Must exist and be writable. Default ``None``: the
    ``SSDTRAIN_SPILL_DIR`` environment variable (``os.pathsep``-separated list) when
    created through :meth:`from_env`, else ``ssdtrain-<uid>`` in the system temporary
    directory, which ssdtrain creates with mode 0700. A spill directory must belong to
    this user or root, and a world-writable one needs the sticky bit (as ``/tmp`` has);
    a symbolic link is followed only if it belongs to this user or root. A warning is
    logged when it lies on a file system held in RAM (tmpfs, ramfs, devtmpfs), where
    offloading frees nothing."""

    min_tensor_bytes: int = 256 * KiB
    """Saved tensors smaller than this stay in memory: below it the per-request cost
    outweighs the memory freed. Default 256 KiB."""

    prefetch_bytes: int = 256 * MiB
    """How many bytes of saved activations may be in memory ahead of backward's use:
    the kept tail counts, and reads (in reverse order of saving, from the end of
    forward) fill the rest as backward consumes. Larger hides more read latency and uses
    more memory during backward. With ``policy="auto"`` a step may read further ahead
    when its loads would otherwise come late, never holding more than its forward's end
    held (``Stats.prefetch_window_bytes``). Default 256 MiB."""

    keep_tail_bytes: int = 128 * MiB
    """The last activations of forward, up to this many bytes, are never written: backward
    needs them first, so writing and reading them back would only stall it. Writes lag
    forward by this much. Default 128 MiB; ``0`` offloads everything eligible."""

    engine: str = "auto"
    """I/O engine: ``"auto"`` (``"kvikio"`` where a real GPUDirect Storage test I/O in
    every spill directory succeeds and ``verify`` is off, else ``"native"`` where
    ``ssdtrain._C`` is built, else ``"posix"``; the choice and why is logged once and
    shown in :attr:`Stats.engine`), ``"kvikio"`` (GPUDirect Storage: CUDA records go
    between device memory and NVMe with no host copy; needs ``pip install
    ssdtrain[gds-cu12]`` or ``[gds-cu13]``, a CUDA GPU and cuFile, else :class:`ConfigError` says why),
    ``"native"`` (the C++ engine: io_uring or a thread pool, raising
    :class:`ConfigError` if it is not built) or ``"posix"`` (pure-Python
    ``pwrite``/``preadv`` on a thread pool, the reference). Default ``"auto"``."""

    io_threads: int = 4
    """Worker threads doing I/O; each blocking call releases the GIL. Default 4."""

    io_chunk_bytes: int = 16 * MiB
    """Requests larger than this are split into chunks handled by several workers.
    Rounded to a multiple of 4 KiB. Default 16 MiB."""

    direct_io: str = "auto"
    """``"on"``: use ``O_DIRECT`` (bypass the page cache), fail if the file system
    refuses it. ``"off"``: buffered I/O; each record's own blocks are then synced
    (``sync_file_range``) and dropped (``POSIX_FADV_DONTNEED``), so written data still
    leaves RAM. ``"auto"``: ``O_DIRECT``
    where the file system supports it. Default ``"auto"``."""

    write_behind_bytes: int = 1 * GiB
    """Most bytes whose writes (and copies to the host tier) may be in flight at once,
    under every policy. When forward saves faster than the disk takes them, the pack
    that goes beyond it waits for the oldest write (counted in
    :attr:`Stats.write_stall_seconds`), so memory stays bounded by
    ``keep_tail_bytes + write_behind_bytes`` plus one record. Under
    ``policy="auto"`` forward does not wait (unless memory sets a floor): the writes
    past it wait in memory, and one whose graph is freed before it starts is never
    written (:attr:`Stats.unwritten_bytes`; INV-BOUNDED). Default 1 GiB; ``0``
    waits for every write before forward goes on (for debugging)."""

    verify: Union[bool, str] = "auto"
    """Checksum every record (CRC32C, the SSE4.2 instruction where present) when it is
    written and check it when it is read back; a mismatch raises
    :class:`~ssdtrain.IntegrityError` (a truncated spill file does even without it).
    ``True`` needs ``ssdtrain._C`` (the native module). ``"auto"``: on where
    ``ssdtrain._C`` is built and the engine is ``native`` or ``posix``, off for
    ``kvikio`` (device records never pass through host memory there); the
    :class:`~ssdtrain.Offloader`'s ``config`` shows the outcome. Its measured cost is
    about 1-2% of step time (``benchmarks/verify_overhead.py``). Default ``"auto"``."""

    io_timeout_s: float = 600.0
    """Longest wait for one I/O request before a :class:`~ssdtrain.SpillIOError` names the
    record and the file. At most ``threading.TIMEOUT_MAX`` (about 292 years).
    Default 600 s."""

    on_spill_error: str = "raise"
    """What a failed write does (full or failing device, file size limit, quota):
    ``"raise"``: a :class:`~ssdtrain.SpillIOError` at the next pack, at the end of
    forward, or at the latest when backward needs the record. ``"keep"``: the record
    stays in memory (its bytes were never released), a warning is logged once per
    offloader, and training goes on exactly, using more memory; the failure is
    counted in :attr:`Stats.spill_errors`. A failed *read* always raises: by then the
    memory is gone. Default ``"raise"``."""

    max_spill_bytes: Optional[int] = None
    """Disk budget: most bytes of spill-file slots in use at once, over all directories
    (counted in whole 4 KiB blocks). A record whose write would go beyond it is handled
    as ``on_spill_full`` says. Default ``None``: no budget (the device's free space is
    the limit, and a full device is a write error, see ``on_spill_error``)."""

    host_budget_bytes: Union[int, str, None] = None
    """The host-RAM tier (NOTE [ Host tier ] in ``ssdtrain/_store/hosttier.py``): most bytes of
    device records (CUDA tensors) held in pinned host memory. Records that leave device
    memory go to RAM while the budget allows; beyond it the earliest saved go to the SSD
    (backward needs them last), and backward loads from RAM what is there. With a host
    budget ``spill_dir`` is optional: without one nothing is written to disk, and
    records beyond the budget stay in device memory (a ``save_on_cpu`` with dedup, a
    budget and prefetch). CPU tensors are not moved (they are in host RAM already): with
    an SSD tier they are written as before, without one they stay. ``"auto"``: half of
    the memory the process may use: its own memory cgroup's limit (the least along its
    path, cgroup v1 or v2), else the machine's RAM (not capped by ``RLIMIT_MEMLOCK``,
    which does not count CUDA's pinned memory; NOTE [ Memory limits ] in
    ``ssdtrain/_limits.py``); :attr:`ResolvedConfig.host_budget_reason` says which.
    ``"unlimited"``: no limit. Pinned buffers are rounded up by the host allocator
    (``Stats.staging_bytes`` shows what is held). Default ``None``: no host tier, device
    records go to the SSD through pinned staging."""

    on_spill_full: str = "keep"
    """What a record beyond ``max_spill_bytes`` does: ``"keep"`` it in memory (counted
    in :attr:`Stats.over_budget_bytes`; a warning is logged once per offloader) or
    ``"raise"`` a :class:`~ssdtrain.SpillIOError` (errno ``ENOSPC``), like a failed
    write: at the next pack, or at the end of forward. Default ``"keep"``."""
    policy: str = "auto"
    """``"auto"``: each step offloads what the disk can write during forward and read
    back during backward without slowing the step by more than ``max_slowdown``, and
    keeps the rest; the amount (a byte quota per step, the earliest-saved records first)
    is chosen from what earlier steps measured: the step's times, the bytes it saves,
    the disk's bandwidth (probed once) and whether a step was slowed (docs/guide.md,
    "How policy='auto' decides"). It fits first: the first step offloads as ``"static"``
    does, and every later step at least what must leave memory for 10% of it to stay
    free (the memory floor, read at each forward's end); the next two steps measure at
    that floor. Forward waits for writes (``write_behind_bytes``) only while the floor is
    above 0. ``"static"``: every eligible saved tensor is offloaded at every step, the
    last ``keep_tail_bytes`` of forward stay in memory: the most memory saved, whatever
    it costs in time (a warning, once, when a step spent a quarter of its time waiting
    on the SSD). ``"adaptive"``: after
    :meth:`~ssdtrain.Offloader.track`, the first ``profile_steps`` steps are profiled
    (per layer: saved bytes, forward and backward time; the engine's write and read
    bandwidth), then one step with every layer recomputed (compute-only times), then
    each layer is kept, offloaded or recomputed (non-reentrant checkpointing) to
    minimise the predicted step time within ``memory_budget_bytes``
    (docs/planner.md); needs ``memory_budget_bytes``. Default ``"auto"``."""

    max_slowdown: float = 0.03
    """With ``policy="auto"``: how much slower than without offloading a step may be,
    as a fraction of its time (``0.03``: 3%). The quota stays where the disk's reads and
    writes fit in the step with this margin, and drops after a step that waited on I/O
    or took longer than that. In ``[0, 10]``. Default 0.03."""

    memory_budget_bytes: Optional[int] = None
    """With ``policy="adaptive"``: most bytes of saved activations the plan may hold in
    memory at once (kept layers, writes in flight, the prefetch window, a recomputed
    layer's activations during its backward, and what the rest of the model keeps).
    Default ``None`` (required by ``"adaptive"``; with ``"static"``,
    :meth:`~ssdtrain.Offloader.plan` then plans without a limit)."""

    profile_steps: int = 2
    """Steps profiled after :meth:`~ssdtrain.Offloader.track` (under the static rules)
    before the adaptive policy plans; per layer the fastest time seen is used (the
    first step pays one-time costs). Default 2."""

    replan_stall_fraction: float = 0.05
    """With ``policy="adaptive"``: re-plan (with the disk bandwidth scaled down to what
    the step saw) when a step stalls on I/O for more than this fraction of its
    duration and more than the plan predicted. ``float("inf")`` never re-plans.
    Default 0.05."""

    def __post_init__(self):
        if not (isinstance(self, ResolvedConfig) and self.spill_dir == []):  # no SSD tier
            _set(self, "spill_dir", _normalize_dirs(self.spill_dir))
        for name in ("min_tensor_bytes", "prefetch_bytes", "keep_tail_bytes", "io_chunk_bytes",
                     "write_behind_bytes"):
            _set(self, name, parse_bytes(getattr(self, name), name=name))
        if self.io_chunk_bytes < 4 * KiB:
            raise ConfigError(f"ssdtrain: io_chunk_bytes must be at least 4096, got "
                              f"{self.io_chunk_bytes}; the default is {16 * MiB}.")
        _set(self, "io_chunk_bytes", self.io_chunk_bytes - self.io_chunk_bytes % (4 * KiB))
        if self.engine not in ENGINES:
            raise ConfigError(f"ssdtrain: engine must be one of {ENGINES}, got {self.engine!r}.")
        if isinstance(self.io_threads, bool) or not isinstance(self.io_threads, int) \
                or not 1 <= self.io_threads <= 256:
            raise ConfigError(f"ssdtrain: io_threads must be an int in [1, 256], got "
                              f"{_show(self.io_threads)}.")
        if isinstance(self.direct_io, bool):
            _set(self, "direct_io", "on" if self.direct_io else "off")
        if self.direct_io not in DIRECT_IO_MODES:
            raise ConfigError(f"ssdtrain: direct_io must be one of {DIRECT_IO_MODES} (or a bool), "
                              f"got {self.direct_io!r}.")
        if not isinstance(self.verify, bool) and self.verify != "auto":
            raise ConfigError(f"ssdtrain: verify must be True, False or 'auto', got "
                              f"{self.verify!r}.")
        # Waits pass it to lock acquisition, which refuses more than TIMEOUT_MAX
        # (about 292 years) with an OverflowError.
        timeout = _number(self.io_timeout_s, name="io_timeout_s", minimum=0,
                          maximum=threading.TIMEOUT_MAX,
                          what=f"a number of seconds > 0 and at most {threading.TIMEOUT_MAX:.0f} "
                               f"(threading.TIMEOUT_MAX)")
        if type(self.io_timeout_s) is not int:
            _set(self, "io_timeout_s", timeout)
        if self.on_spill_error not in SPILL_ERROR_ACTIONS:
            raise ConfigError(f"ssdtrain: on_spill_error must be one of {SPILL_ERROR_ACTIONS}, "
                              f"got {self.on_spill_error!r}.")
        if self.max_spill_bytes is not None:
            _set(self, "max_spill_bytes", parse_bytes(self.max_spill_bytes, name="max_spill_bytes"))
        if self.host_budget_bytes is not None and self.host_budget_bytes not in ("auto",
                                                                                "unlimited"):
            _set(self, "host_budget_bytes", parse_bytes(self.host_budget_bytes,
                                                        name="host_budget_bytes"))
        if self.on_spill_full not in SPILL_FULL_ACTIONS:
            raise ConfigError(f"ssdtrain: on_spill_full must be one of {SPILL_FULL_ACTIONS}, "
                              f"got {self.on_spill_full!r}.")
        self._validate_planner_fields()

    def _validate_planner_fields(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"ssdtrain: policy must be one of {POLICIES}, got {self.policy!r}.")
        m = _number(self.max_slowdown, name="max_slowdown", minimum=-1.0, maximum=10.0,
                    what="a fraction of the step time in [0, 10], such as 0.03 (3%)")
        if m < 0:
            raise ConfigError(f"ssdtrain: max_slowdown must be a fraction of the step time in "
                              f"[0, 10], such as 0.03 (3%), got {_show(self.max_slowdown)}.")
        if type(self.max_slowdown) is not int:
            _set(self, "max_slowdown", m)
        if self.memory_budget_bytes is not None:
            _set(self, "memory_budget_bytes", parse_bytes(self.memory_budget_bytes,
                                                          name="memory_budget_bytes"))
        elif self.policy == "adaptive":
            raise ConfigError("ssdtrain: policy='adaptive' needs memory_budget_bytes (the most "
                              "bytes of activations the plan may keep in memory), e.g. "
                              "memory_budget_bytes='2GiB'; or use policy='auto' (the default) "
                              "or 'static'.")
        if isinstance(self.profile_steps, bool) or not isinstance(self.profile_steps, int) \
                or not 1 <= self.profile_steps <= 1000:
            raise ConfigError(f"ssdtrain: profile_steps must be an int in [1, 1000], got "
                              f"{_show(self.profile_steps)}.")
        f = _number(self.replan_stall_fraction, name="replan_stall_fraction", minimum=0,
                    maximum=sys.float_info.max, allow_inf=True,
                    what="a number > 0 (float('inf'): never re-plan)")
        if type(self.replan_stall_fraction) is not int:
            _set(self, "replan_stall_fraction", f)

    @classmethod
    def from_env(cls, environ=None, **overrides):
        """Build a config from ``SSDTRAIN_*`` environment variables, then ``overrides``.

        The variables are ``SSDTRAIN_`` + the upper-case field name, e.g.
        ``SSDTRAIN_SPILL_DIR=/nvme0/a:/nvme1/b``, ``SSDTRAIN_PREFETCH_BYTES=1GiB``,
        ``SSDTRAIN_ENGINE=posix``. Unknown ``SSDTRAIN_*`` variables raise
        :class:`ConfigError` (a typo should not be silently ignored), except
        ``SSDTRAIN_TEST_*``, which are ssdtrain's own test suite's knobs (tests/).
        """
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, raw in environ.items():
            if not key.startswith("SSDTRAIN_") or key.startswith("SSDTRAIN_TEST_"):
                continue
            name = key[len("SSDTRAIN_"):].lower()
            if name not in fields:
                raise ConfigError(f"ssdtrain: unknown environment variable {key}; known ones are "
                                  + ", ".join("SSDTRAIN_" + n.upper() for n in fields) + ".")
            kwargs[name] = _from_env_string(name, raw)
        unknown = set(overrides) - set(fields)
        if unknown:
            raise ConfigError(f"ssdtrain: unknown OffloadConfig field(s) {sorted(unknown)}; "
                              f"known fields are {sorted(fields)}.")
        kwargs.update(overrides)
        return cls(**kwargs)

    def replace(self, **overrides) -> "OffloadConfig":
        """A copy with ``overrides`` applied (validated like the constructor).

        On a :class:`ResolvedConfig` the copy is a plain :class:`OffloadConfig` of
        its effective values with ``overrides`` applied, resolved again by the
        :class:`~ssdtrain.Offloader` it is given to.
        """
        names = {f.name for f in dataclasses.fields(OffloadConfig)}
        unknown = set(overrides) - names
        if unknown:
            raise ConfigError(f"ssdtrain: unknown OffloadConfig field(s) {sorted(unknown)}.")
        values = {name: getattr(self, name) for name in names}
        values.update(overrides)
        return OffloadConfig(**values)

    def resolve(self) -> "ResolvedConfig":
        """The settings an :class:`~ssdtrain.Offloader` runs with, every ``"auto"`` and
        default decided once (NOTE [ One resolved config ]):

        * ``spill_dir``: the configured directories, checked (they exist, are
          directories, and are private: NOTE [ Spill directory privacy ]); ``None``
          becomes ``[default spill directory]`` (created 0700);
        * ``engine``: ``"auto"`` becomes ``"kvikio"``, ``"native"`` or ``"posix"``
          (why: :attr:`ResolvedConfig.engine_reason`);
        * ``verify``: ``"auto"`` becomes ``True`` where ``ssdtrain._C`` is built and the
          engine is not ``kvikio``, else ``False``;
        * ``host_budget_bytes``: ``"auto"`` and ``"unlimited"`` become a byte count
          (why: :attr:`ResolvedConfig.host_budget_reason`); with it and no
          ``spill_dir``, ``spill_dir`` becomes ``[]`` (no SSD tier: no directory is
          created, probed or written).

        ``direct_io`` stays as asked: ``O_DIRECT`` is decided per spill file when it is
        opened (``Stats.engine`` shows the outcome). A resolved config resolves to
        itself.

        Raises:
            ConfigError: a spill directory is missing or not private, the named engine is
                not available, or ``verify=True`` cannot be honoured.
        """
        if isinstance(self, ResolvedConfig):
            return self
        from .io import checksum as _checksum, spill as _spill
        from ._device import transfers as _device
        from . import io  # the store layer resolves (Layers)
        host, host_why = resolve_budget(self.host_budget_bytes)
        if self.spill_dir is not None:
            dirs = self.spill_dir
        elif host is not None:
            dirs = []  # a host tier and no SSD tier: nothing is ever written to disk
        else:
            dirs = [_spill.default_spill_dir()]
        if not dirs and self.policy == "adaptive":
            raise ConfigError("ssdtrain: policy='adaptive' plans against an SSD's bandwidth; "
                              "with host_budget_bytes and no spill_dir there is none. Give a "
                              "spill_dir, or use policy='static'.")
        if not dirs and self.max_spill_bytes is not None:
            raise ConfigError("ssdtrain: max_spill_bytes is a budget for the SSD tier, but "
                              "host_budget_bytes without a spill_dir has none; give a "
                              "spill_dir, or drop max_spill_bytes.")
        for d in dirs:
            _spill.check_spill_dir(d)
        if self.verify is True and not _checksum.available():
            _checksum.crc32c(0, 0)  # raises the ConfigError that says what to do
        engine, why = io.choose_engine(self.engine, directories=dirs,
                                       verify=self.verify is True,
                                       gds_memory=_device.GDS_PROBE_MEMORY)
        verify = self.verify
        if verify == "auto":  # on wherever records pass through host memory
            verify = _checksum.available() and engine != "kvikio"
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(OffloadConfig)}
        values.update(spill_dir=dirs, engine=engine, verify=verify, host_budget_bytes=host)
        return ResolvedConfig(**values, engine_reason=why, host_budget_reason=host_why)


@dataclass(kw_only=True, frozen=True)
class ResolvedConfig(OffloadConfig):
    """An :class:`OffloadConfig` with every default and ``"auto"`` decided: made by
    :meth:`OffloadConfig.resolve`, shown as :attr:`Offloader.config
    <ssdtrain.Offloader.config>`, and the only kind of config the store, the planner
    and the policies read. ``spill_dir`` is a list of directories (empty: no SSD tier,
    only with a host tier), ``engine`` names a concrete engine, ``verify`` is a bool,
    ``host_budget_bytes`` is None or a byte count."""

    engine_reason: str = dataclasses.field(default="", compare=False)
    """Why :attr:`engine` was chosen (the configured name, or what ``"auto"`` saw); not
    compared: configs with the same settings are equal whatever led to them."""

    host_budget_reason: str = dataclasses.field(default="", compare=False)
    """Where :attr:`host_budget_bytes` came from: for ``"auto"``, e.g. ``"half of the
    cgroup memory limit 2.00 GiB (memory.max of /job)"`` or ``"half of the machine's
    memory ..."``; ``"as configured"``, ``"unlimited"``, or ``""`` without a host tier.
    Not compared."""

    def __post_init__(self):
        super().__post_init__()
        if self.spill_dir is None or self.engine == "auto" or not isinstance(self.verify, bool) \
                or self.host_budget_bytes in ("auto", "unlimited") \
                or (self.spill_dir == [] and self.host_budget_bytes is None):
            raise ConfigError("ssdtrain: a ResolvedConfig needs spill_dir, a concrete engine and "
                              "a bool verify; make one with OffloadConfig.resolve().")


def default(name: str):
    """The default of the :class:`OffloadConfig` field ``name``: the one definition of
    each default, for code that needs it without a config (the planner's
    ``StepCost``, command-line parsers)."""
    return OffloadConfig.__dataclass_fields__[name].default


def _set(config, name, value):
    """Store a normalized field value on a frozen config (``__post_init__`` only)."""
    object.__setattr__(config, name, value)


def _from_env_string(name, raw):
    if name == "spill_dir":
        return [p for p in raw.split(os.pathsep) if p]
    if name in ("io_threads", "profile_steps"):
        return _env_number(name, raw, integer=True)
    if name in ("replan_stall_fraction", "io_timeout_s", "max_slowdown"):
        return _env_number(name, raw)
    if name == "verify":
        if raw.strip().lower() == "auto":
            return "auto"
        value = _BOOLS.get(raw.strip().lower())
        if value is None:
            raise ConfigError(f"ssdtrain: SSDTRAIN_VERIFY must be 'auto' or one of "
                              f"{sorted(_BOOLS)}, got {raw!r}.")
        return value
    if name in ("max_spill_bytes", "host_budget_bytes") and raw.strip().lower() in ("", "none"):
        return None
    if name == "host_budget_bytes" and raw.strip().lower() in ("auto", "unlimited"):
        return raw.strip().lower()
    return raw  # byte fields parse strings themselves; engine/direct_io are names


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _normalize_dirs(value) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if isinstance(value, bytes) or not isinstance(value, (list, tuple)):
        raise ConfigError(f"ssdtrain: spill_dir must be a path or a list of paths, got "
                          f"{type(value).__name__} {value!r}.")
    if not value:
        raise ConfigError("ssdtrain: spill_dir is an empty list; give at least one directory.")
    out = []
    for v in value:
        if not isinstance(v, (str, os.PathLike)) or not os.fspath(v):
            raise ConfigError(f"ssdtrain: spill_dir entries must be non-empty paths, got {v!r}.")
        out.append(os.path.abspath(os.fspath(v)))
    if len(set(out)) != len(out):
        raise ConfigError(f"ssdtrain: spill_dir lists a directory twice: {out}.")
    return out


# ------------------------------------------------------- host_budget_bytes
def default_host_budget(memory=None):
    """``host_budget_bytes="auto"`` (NOTE [ Host tier ] in _store/hosttier.py): ``(bytes,
    why)``, half of the host memory this process may use (``memory``: a ``_limits.HostMemory``, by default
    :func:`~ssdtrain._limits.host_memory`'s), and where that came from."""
    memory = host_memory() if memory is None else memory
    return memory.total // 2, "half of " + memory.describe()


def resolve_budget(value):
    """``(bytes or None, why)`` for ``host_budget_bytes``: ``"auto"`` is
    :func:`default_host_budget`, ``"unlimited"`` the largest byte count, None no host
    tier. ``OffloadConfig.resolve`` and the estimate both use it."""
    if value == "auto":
        return default_host_budget()
    if value == "unlimited":
        return MAX_BYTES, "unlimited"
    return value, "" if value is None else "as configured"


def budget_bytes(value):
    """``host_budget_bytes`` as a byte count, or None (no host tier):
    :func:`resolve_budget` without the reason."""
    return resolve_budget(value)[0]


def has_ssd_tier(cfg) -> bool:
    """Whether ``cfg`` (resolved or not) has an SSD tier: a ``spill_dir``, or none given
    and no host tier (the default directory is then used)."""
    if cfg.spill_dir is None:
        return cfg.host_budget_bytes is None
    return bool(cfg.spill_dir)
