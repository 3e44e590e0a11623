"""Helpers shared by the test files: one training step, exact comparison, saving by hand.

Imported as a plain module (``from helpers import run_step``); conftest.py puts this
directory on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import socket
import threading
import time
import warnings
from dataclasses import dataclass

import torch
from ssdtrain import testing

__all__ = ["run_step", "StepResult", "numerics_env", "assert_same", "ReferenceNotReproduced",
           "SaveForBackward", "save_and_unpack", "EngineCalls", "WeeklyShard", "weekly_shard",
           "part_id", "ALL_SHARDS_ENV"]


class StepResult(tuple):
    """``(loss, grads)`` from :func:`run_step`, with ``env`` (the process state the
    step's numerics depend on, :func:`numerics_env`, read as it began) and, for a
    reference step (no offloader), ``again``: a callable that runs it once more."""

    def __new__(cls, loss, grads, env, again=None):
        result = super().__new__(cls, (loss, grads))
        result.env = env
        result.again = again
        return result


def numerics_env():
    """What in this process can change a CPU step's floating-point results without
    changing its inputs: thread count, matmul precision, deterministic mode, autocast,
    active torch function/dispatch modes, the default dtype and whether
    ``torch.nn.functional.linear`` is torch's own (DeepSpeed's ZeRO-3 replaces it)."""
    linear = torch.nn.functional.linear
    return {
        "threads": torch.get_num_threads(),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
        "function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "default_dtype": str(torch.get_default_dtype()),
        "mkldnn": torch.backends.mkldnn.enabled,
        "linear": f"{linear.__module__}.{linear.__qualname__}",
    }


def run_step(model, inputs, offloader=None, *, settle=False, backward_inside=False):
    """One step: zero grads, forward (under ``offloader`` when given), backward.

    Args:
        model: the module; its forward returns a scalar loss.
        inputs: positional arguments of ``model``.
        offloader: an :class:`ssdtrain.Offloader`, or ``None`` for the reference run.
        settle: call ``offloader.wait()`` before leaving the ``with`` block, so every
            write has completed when forward ends (prefetch then has to read, not
            forward, each record). Default False: writes may still be in flight.
        backward_inside: call ``backward()`` inside the ``with`` block. Default False.

    Returns:
        a :class:`StepResult`, ``(loss, grads)``: the detached loss and
        ``{name: grad}``, both cloned. A reference result (``offloader`` None) can run
        again (``assert_same`` does so on a mismatch).
    """
    env = numerics_env()
    model.zero_grad(set_to_none=True)
    ctx = offloader if offloader is not None else contextlib.nullcontext()
    with ctx:
        loss = model(*inputs)
        if settle and offloader is not None:
            offloader.wait()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    grads = {name: (None if p.grad is None else p.grad.clone())
             for name, p in model.named_parameters()}
    again = None
    if offloader is None:
        def again():
            return run_step(model, inputs, backward_inside=backward_inside)
    return StepResult(loss.detach().clone(), grads, env, again)


def assert_same(ref, got, again=None):
    """``ref`` and ``got`` are ``run_step`` results that must be bitwise equal.

    On a mismatch the message names every tensor that differs, how many elements and by
    how many units in the last place (a different summation order moves a few; wrong
    input bytes move hundreds, or all of them).

    NOTE [ A reference that does not reproduce ]: on a mismatch the reference step runs
    once more without offloading (``again``, a callable, or ``ref.again`` from
    ``run_step``). If that second reference differs from the first, the reference was
    not reproducible at that moment: the process's numerics changed between the two
    (a clean-clone CI run once saw the first reference step of a test differ by 20 ulps
    in the loss from every later step of the same model, offloaded or not). Then
    ``got`` must be bitwise equal to the second reference instead, and a warning says
    what changed (``numerics_env`` before each step). ``got`` equal to neither fails.
    A mismatch the second reference reproduces fails: ssdtrain is what differs.
    """
    ref_loss, ref_grads = ref
    loss, grads = got
    assert loss.dtype == ref_loss.dtype
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None, f"reference gradient of {name} is None"
        grad = grads[name]
        assert grad is not None, f"gradient of {name} is None"
        assert grad.dtype == ref_grad.dtype and grad.shape == ref_grad.shape, name
    wrong = _differences(ref, got)
    if not wrong:
        return
    first, _ = wrong[0]
    if first == "loss":
        head = f"loss {loss.item()!r} != reference {ref_loss.item()!r}"
    else:
        diff = (grads[first].double() - ref_grads[first].double()).abs().max().item()
        head = f"gradient of {first} differs from the reference (max abs diff {diff!r})"
    lines = [head, "differing: " + "; ".join(f"{name}: {what}" for name, what in wrong)]
    again = again if again is not None else getattr(ref, "again", None)
    if again is not None:
        second = again()
        other = _differences(ref, second)
        if not other:
            lines.append("a second run without offloading is bitwise equal to the reference")
        else:
            changed = _env_change(getattr(ref, "env", None), getattr(second, "env", None))
            if not _differences(second, got):
                warnings.warn(
                    "the reference step did not reproduce (a second run without offloading "
                    f"differs from it: {'; '.join(f'{n}: {w}' for n, w in other)}; "
                    f"process state {changed}); the offloaded step is bitwise equal to the "
                    "second reference", ReferenceNotReproduced, stacklevel=2)
                return
            lines.append(
                "a second run without offloading differs from the reference too (the "
                f"reference is not reproducible here; process state {changed}) and from "
                "the offloaded step: " + "; ".join(
                    f"{name}: {what}" for name, what in _differences(second, got)))
    raise AssertionError("\n".join(lines))


class ReferenceNotReproduced(UserWarning):
    """A reference step differed from a second run of itself (NOTE [ A reference that
    does not reproduce ])."""


def _env_change(before, after):
    """What differs between two ``numerics_env`` readings, in words."""
    if before is None or after is None:
        return "not recorded"
    changed = [f"{key} {before[key]!r} -> {after[key]!r}" for key in before
               if before[key] != after.get(key)]
    return "changed: " + ", ".join(changed) if changed else "unchanged (threads, modes, flags)"


def _differences(ref, got):
    """``[(name, description)]`` of the loss (named ``loss``) and the gradients of
    ``got`` that are not bitwise equal to ``ref``'s, in ``ref``'s order."""
    pairs = [("loss", ref[0], got[0])] + [(n, g, got[1][n]) for n, g in ref[1].items()]
    return [(name, _how_different(want, have)) for name, want, have in pairs
            if not torch.equal(have, want)]


def _how_different(want, have):
    """``k of n elements, max abs diff d, max u ulps`` (ulps of the reference values)."""
    if have.shape != want.shape or not want.is_floating_point():
        return f"{list(have.shape)} vs {list(want.shape)}"
    differ = have != want
    diff = (have.double() - want.double()).abs()
    info = torch.finfo(want.dtype)
    _, exp = torch.frexp(want.double().abs())
    ulp = torch.ldexp(torch.full_like(diff, info.eps), exp - 1)
    tiny = info.smallest_normal * info.eps  # the spacing of zero and the subnormals
    ulp = torch.where(want.abs() < info.smallest_normal, torch.full_like(ulp, tiny), ulp)
    return (f"{int(differ.sum())} of {want.numel()} elements, max abs diff "
            f"{diff.max().item():.3g}, max {(diff / ulp).max().item():.0f} ulps")


class SaveForBackward(torch.autograd.Function):
    """Saves arbitrary tensors (any dtype, any view) with ``ctx.save_for_backward``.

    ``SaveForBackward.apply(anchor, sink, *tensors)`` returns ``anchor * 1``; the
    backward appends what ``ctx.saved_tensors`` gave back to the list ``sink``
    (the unpacked tensors themselves, so their geometry can be checked). ``anchor``
    must require grad so that there is a graph at all.
    """

    @staticmethod
    def forward(ctx, anchor, sink, *tensors):
        ctx.sink = sink
        ctx.save_for_backward(*tensors)
        return anchor * 1

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.append(list(ctx.saved_tensors))
        return (grad, None) + (None,) * len(ctx.needs_input_grad[2:])


def save_and_unpack(tensors, offloader, *, settle=True):
    """Save ``tensors`` under ``offloader`` in one node, run backward, return the unpacked ones.

    With ``settle`` (default True) every write has completed before the ``with``
    block ends.
    """
    anchor = torch.zeros((), requires_grad=True)
    sink = []
    with offloader:
        out = SaveForBackward.apply(anchor, sink, *tensors)
        if settle:
            offloader.wait()
    out.backward()
    assert len(sink) == 1
    return sink[0]


class EngineCalls:
    """Counts the requests an offloader's engine receives (one call per record I/O).

    Wraps ``engine.write`` and ``engine.read`` on the instance; ``writes`` and
    ``reads`` list ``(address, nbytes)`` per call.
    """

    def __init__(self, offloader):
        self.engine = testing.engine(offloader)
        self.writes = []
        self.reads = []
        self._lock = threading.Lock()
        self._write, self._read = self.engine.write, self.engine.read
        self.engine.write = self._wrap(self._write, self.writes)
        self.engine.read = self._wrap(self._read, self.reads)

    def _wrap(self, fn, calls):
        def counted(file, offset, address, nbytes, **kw):  # kw: crc=True (Engine.checksums)
            with self._lock:
                calls.append((address, nbytes))
            return fn(file, offset, address, nbytes, **kw)
        return counted

    def writes_within(self, storage: torch.UntypedStorage):
        """The write calls whose source bytes lie inside ``storage``."""
        lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        return [(a, n) for a, n in self.writes if lo <= a and a + n <= hi]


def gated(request, gate, timeout=60.0):
    """``request`` (an engine's ``write`` or ``read``) made to wait for ``gate`` (a
    ``threading.Event``): each call returns a future at once and makes the real request
    on a thread of its own once the gate opens, the owner held meanwhile (in the call's
    arguments). Nothing waits for the gate on the thread that settles the engine's
    futures, which with a polled engine is whoever polls (NOTE [ Polled completions ] in
    ssdtrain/io/base.py): a gate chained behind the request (``then``) would block the
    training thread itself."""
    from concurrent.futures import Future

    def call(*args, **kwargs):
        outer = Future()
        outer.set_running_or_notify_cancel()

        def go():
            gate.wait(timeout)
            try:
                outer.set_result(request(*args, **kwargs).result(timeout))
            except BaseException as e:  # noqa: BLE001 - the store sees the outcome
                outer.set_exception(e)
        threading.Thread(target=go, name="gated-request", daemon=True).start()
        return outer
    return call


def grads(model):
    """``{name: grad}`` of ``model``'s parameters, cloned."""
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_equal(ref, got):
    """Every gradient of ``got`` is ``torch.equal`` to ``ref``'s (same names)."""
    assert ref.keys() == got.keys()
    for name, g in ref.items():
        assert torch.equal(got[name], g), f"gradient of {name} differs from the reference"


def variant(inputs, i):
    """Micro-batch ``i``: floating inputs scaled, integer ones (tokens, labels) rolled."""
    return tuple(t * (1 + i / 8) if t.is_floating_point() else torch.roll(t, i, dims=-1)
                 for t in inputs)


# NOTE [ Sweeps take turns by week ]
#
# The sweeps that search every line (KeyboardInterrupt at each line a scenario runs:
# tests/test_interrupts.py, test_loopback_sweeps.py, test_hosttier.py) and the
# estimate's check of every generated architecture (tests/test_decision.py) take too
# long to run whole in every `make test` (the suite's time on CI's two cores). Each is
# split into ``count`` parts (shards) by a fixed rule (a sweep: the j-th target of each
# file in its deterministic target list is in part j % count, tests/inject.py shard_of;
# the architectures: the i-th of the list in part i % count), and a default run runs
# the part of this ISO week: the week number modulo ``count``. Over ``count``
# consecutive weeks CI runs every part. A part that runs runs every target it selects,
# with the checks of the whole sweep, so a line that breaks fails in the week its part
# runs (at the latest ``count`` weeks after the change; each sweep's count is beside it).
# SSDTRAIN_TEST_ALL_SHARDS=1 (or SSDTRAIN_TEST_INTERRUPT_FULL=1, which also runs the full
# sweeps) runs every part of every such test: what a default run covered before the split.
ALL_SHARDS_ENV = "SSDTRAIN_TEST_ALL_SHARDS"
_ALL_SHARDS_ALSO = ("SSDTRAIN_TEST_INTERRUPT_FULL",)


@dataclass(frozen=True)
class WeeklyShard:
    """Which of ``count`` parts of a split test this run runs (NOTE [ Sweeps take turns by
    week ]): ``index`` (this ISO week's ``week % count``), or every part when ``index`` is
    None."""

    count: int
    index: int | None
    week: int
    switch: str = f"{ALL_SHARDS_ENV}=1"

    def runs(self, part: int) -> bool:
        """Whether part ``part`` (0-based) runs in this run."""
        return self.index is None or part == self.index

    def skip_reason(self, what: str, part: int | None = None) -> str:
        """Why ``what`` (part ``part`` of it, given) does not run: whose turn it is and how
        to run every part."""
        which = "" if part is None else f" (part {part + 1} of {self.count})"
        return (f"{what}{which}: not this ISO week's part; week {self.week} runs part "
                f"{self.index + 1} of {self.count}, in turn; {self.switch} runs every part")


def part_id(part: int, count: int) -> str:
    """``part2of3``: the test id of part ``part`` (0-based) of ``count``."""
    return f"part{part + 1}of{count}"


def weekly_shard(count: int, *switches: str, today: datetime.date | None = None) -> WeeklyShard:
    """This run's part of a test split into ``count`` parts that take turns by ISO week
    (NOTE [ Sweeps take turns by week ]). Every part when ``SSDTRAIN_TEST_ALL_SHARDS=1``,
    ``SSDTRAIN_TEST_INTERRUPT_FULL=1``, or one of ``switches`` (a test's own variables,
    e.g. ``SSDTRAIN_TEST_ALL_ARCHS``) is ``1``. ``today`` defaults to today's date."""
    if count < 1:
        raise ValueError(f"weekly_shard: count must be at least 1, got {count}")
    week = (today or datetime.date.today()).isocalendar()[1]
    names = (ALL_SHARDS_ENV, *_ALL_SHARDS_ALSO, *switches)
    every = any(os.environ.get(name) == "1" for name in names)
    switch = " or ".join(f"{name}=1" for name in dict.fromkeys((*switches, ALL_SHARDS_ENV)))
    return WeeklyShard(count, None if every else week % count, week, switch)


# ------------------------------------------------------ process groups in the tests
def free_port() -> int:
    """A TCP port for a process group's rendezvous, chosen below the kernel's ephemeral
    range: a port bound to 0, closed, then bound again by a rank can meanwhile be taken
    as the source port of any outgoing connection (gloo's ranks, another xdist
    worker's), which failed CI with EADDRINUSE; below the range only another listener
    can take it."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), max(1025, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, args, nprocs, timeout_s, what="ranks", attempts=3) -> None:
    """``fn(rank, port, *args)`` on ``nprocs`` spawned processes, joined within
    ``timeout_s``; a rendezvous whose port another listener took first (EADDRINUSE) is
    run again on a new port, up to ``attempts`` times. Any other failure raises."""
    import torch.multiprocessing as mp
    for attempt in range(attempts):
        ctx = mp.start_processes(fn, args=(free_port(), *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what} still running after {timeout_s} s")
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == attempts - 1:
                raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
