"""The CUDA leaf of the device path: the only module that touches ``torch.cuda``.

Each method is one ``torch.cuda`` call or two; the ordering rules that use them are in
``_device/transfers.py`` (NOTE [ Device records ]), where the loopback device
(``testing/loopback.py``) runs them in CI with the same code. tests/test_device.py runs this
module wherever CUDA exists.
"""

from __future__ import annotations

import torch

__all__ = ["LEAF", "GDS_PROBE_MEMORY", "default_device", "synchronize", "rng_state",
           "set_rng_state", "nvtx_push", "nvtx_pop"]


class _Cuda:
    """The leaf interface of ``_device/transfers.py`` for CUDA devices (``torch.device`` names them)."""

    name = "cuda"

    @staticmethod
    def device(t):
        return t.device

    @staticmethod
    def torch_device(device):
        return device

    @staticmethod
    def capturing(device) -> bool:
        """Whether the current stream is capturing a CUDA graph (rule 8)."""
        return torch.cuda.is_current_stream_capturing()

    @staticmethod
    def entered(device):
        return torch.cuda.device(device)

    @staticmethod
    def new_stream(device):
        return torch.cuda.Stream(device)

    @staticmethod
    def current_stream(device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def using(stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def headroom(device):
        """``(free, total)`` bytes of the device: what the driver has free plus what the
        caching allocator holds unused (it hands that out first)."""
        free, total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), \
            total

    @staticmethod
    def synchronize(device):
        """Wait for the device's queued work, every stream's."""
        torch.cuda.synchronize(device)

    @staticmethod
    def new_event():
        # blocking: a host thread that waits on it sleeps instead of spinning.
        return torch.cuda.Event(blocking=True)

    @staticmethod
    def empty(nbytes, device):
        """Device memory, allocated for the current stream (the caching allocator's pool
        of that stream)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    @staticmethod
    def pinned(nbytes):
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def release_cached_pinned():
        """Give the pinned blocks torch's caching host allocator keeps unused back to the
        system (NOTE [ Bounded staging ] in _device/staging.py: a buffer the staging pool lets go
        of returns to that cache, still pinned). Frees every unused cached block, also
        other users'; they are allocated again when needed."""
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
            getattr(torch._C, "_host_emptyCache", None)
        if empty is not None and torch.cuda.is_initialized():
            empty()

    @staticmethod
    def pinned_size(nbytes):
        """What torch's caching host allocator reserves for ``nbytes``: the next power of
        two (so a request of 128 MiB + 4 KiB would take 256 MiB)."""
        return 1 << (nbytes - 1).bit_length()

    @staticmethod
    def copy(dst, src):
        """An asynchronous copy on the current stream."""
        dst.copy_(src, non_blocking=True)

    @staticmethod
    def record_stream(t, stream):
        t.record_stream(stream)


LEAF = _Cuda()


class _GdsProbeMemory:
    """Device memory for the GPUDirect Storage probe (``ssdtrain.io.gds.probe``), which
    itself never touches CUDA: it is handed :data:`GDS_PROBE_MEMORY` and sees addresses."""

    @staticmethod
    def missing() -> str:
        """Why there is no device to test with, or ``""``."""
        return "" if torch.cuda.is_available() else "no CUDA device is available"

    @staticmethod
    def buffers(nbytes: int):
        """``(source, destination, same)``: the addresses of ``nbytes`` random bytes and of
        ``nbytes`` zeros on the current device (not a context on GPU 0), both ready, and a
        callable telling whether the destination now equals the source. The callable
        holds both buffers: keep it until the test I/O has ended."""
        device = torch.device("cuda", torch.cuda.current_device())
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        torch.cuda.synchronize(device)
        return src.data_ptr(), dst.data_ptr(), lambda: torch.equal(src, dst)


GDS_PROBE_MEMORY = _GdsProbeMemory()


# ------------------------------------------------------------------ for tools (ssdtrain check)
def default_device() -> torch.device:
    """The device a tool runs a model on when none is named: CUDA where available."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): for timing a step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state(device: torch.device) -> dict:
    """The random-number state a step on ``device`` draws from: the CPU generator's, and
    the device's own on CUDA (``{"cpu": ..., "cuda": ...}``)."""
    state = {"cpu": torch.random.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ------------------------------------------------------- NVTX (NOTE [ Profiler ranges ])
def nvtx_push(name: str) -> bool:
    """Open the NVTX range ``name`` on this thread where CUDA is in use (initialized in
    this process; never initializes it); whether one was opened. Only while a profiler
    runs (``_trace.begin``): Nsight Systems shows it beside torch's ``emit_nvtx()``
    ranges."""
    if not torch.cuda.is_initialized():
        return False
    torch.cuda.nvtx.range_push(name)
    return True


def nvtx_pop() -> None:
    """Close the innermost NVTX range :func:`nvtx_push` opened on this thread."""
    torch.cuda.nvtx.range_pop()
