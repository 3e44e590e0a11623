"""Run megatron-core on a CPU-only torch, for the Megatron adapter's tests and example.

megatron-core assumes CUDA in a few places that a tiny fp32 ``GPTModel`` built with
the local layer spec (``get_gpt_layer_local_spec``) reaches on its training path:

* the model-parallel RNG tracker: ``CudaRNGStatesTracker.add`` calls
  ``torch.cuda.get_rng_state``/``torch.cuda.manual_seed``, and ``fork`` and the
  checkpoint functions go through ``tensor_parallel.random._get_cuda_rng_state`` /
  ``_set_cuda_rng_state``. Here the "CUDA" generator is the CPU default generator:
  ``fork`` swaps its state exactly as it swaps the CUDA generator's on a GPU, so
  dropout inside a fork and Megatron's recompute replay the same random numbers.
* the global memory buffer (``parallel_state._GLOBAL_MEMORY_BUFFER``) that
  ``DotProductAttention`` takes its ``baddbmm`` destination from allocates on
  ``torch.cuda.current_device()``; here it allocates on the CPU.
* the pipeline schedules and their point-to-point communication
  (``megatron.core.pipeline_parallel.schedules`` and ``.p2p_communication``)
  allocate receive buffers on ``torch.cuda.current_device()``, their token counter
  with ``device="cuda"``, and call ``torch.cuda.synchronize()`` after batched
  ``batch_isend_irecv``. Those two modules see :class:`CPUTorch` as ``torch``: the
  real torch, except that ``torch.cuda.current_device()`` is the CPU,
  ``torch.cuda.synchronize()`` does nothing (gloo's requests are complete once
  waited on) and a ``device="cuda"`` argument of a factory function means the
  CPU. gloo runs ``batch_isend_irecv`` and the plain ``isend``/``irecv`` pairs
  unchanged, so the schedules themselves (1F1B, interleaved) are megatron-core's.

Everything else is real megatron-core: process groups (gloo; world size 1, or the
caller's world for pipeline parallelism), layers, the loss. Parameters are created on
the CPU with ``use_cpu_initialization=True``.

:func:`megatron_cpu` sets all of it up and undoes it; :data:`PATCHED_NAMES` lists the
megatron-core names this module replaces, so a canary test can say which one went
away in a new release.

This is test support, not part of ssdtrain: ``tests/run_megatron_example.py`` enters
:func:`megatron_cpu` and then runs ``examples/megatron_gpt.py`` (which imports nothing
from tests/) on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import warnings

import torch

__all__ = ["PATCHED_NAMES", "CPU_TORCH_MODULES", "CPUTorch", "megatron_cpu", "manual_seed",
           "missing_names"]

# (module, attribute) pairs this shim reads or replaces in megatron-core.
PATCHED_NAMES = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    ("megatron.core.tensor_parallel.random", "_MODEL_PARALLEL_RNG_TRACKER_NAME"),
    ("megatron.core.tensor_parallel.random", "_DATA_PARALLEL_RNG_TRACKER_NAME"),
    ("megatron.core.tensor_parallel.random", "_EXPERT_PARALLEL_RNG_TRACKER_NAME"),
    ("megatron.core.parallel_state", "_GLOBAL_MEMORY_BUFFER"),
    ("megatron.core.parallel_state", "initialize_model_parallel"),
    ("megatron.core.parallel_state", "destroy_model_parallel"),
    ("megatron.core.parallel_state", "model_parallel_is_initialized"),
    ("megatron.core.utils", "GlobalMemoryBuffer"),
    ("megatron.core.pipeline_parallel.schedules", "torch"),
    ("megatron.core.pipeline_parallel.schedules", "get_forward_backward_func"),
    ("megatron.core.pipeline_parallel.p2p_communication", "torch"),
    ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator"),
)

# Modules whose ``torch`` is replaced by a CPUTorch while megatron_cpu() is active.
CPU_TORCH_MODULES = ("megatron.core.pipeline_parallel.schedules",
                     "megatron.core.pipeline_parallel.p2p_communication")


def missing_names(names=PATCHED_NAMES):
    """The ``"module.attribute"`` entries of ``names`` that do not exist (empty if all do)."""
    missing = []
    for module, attr in names:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            missing.append(f"{module} (module)")
            continue
        if not hasattr(mod, attr):
            missing.append(f"{module}.{attr}")
    return missing


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    # Signature of random._get_cuda_rng_state; torch.get_rng_state returns a copy.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    # Signature of random._set_cuda_rng_state.
    torch.set_rng_state(new_state)


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random

    class CPURNGStatesTracker(random.CudaRNGStatesTracker):
        """``CudaRNGStatesTracker`` whose states are states of the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    return CPURNGStatesTracker


def _cpu_buffer_class():
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUGlobalMemoryBuffer(GlobalMemoryBuffer):
        """``GlobalMemoryBuffer`` that allocates on the CPU."""

        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            required = 1
            for n in tensor_shape:
                required *= n
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < required:
                buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
            return buf[0:required].view(*tensor_shape)

    return CPUGlobalMemoryBuffer


class _CPUCuda:
    """The ``torch.cuda`` that :class:`CPUTorch` shows: the current device is the CPU."""

    def __init__(self, real):
        self._real = real

    def current_device(self):
        return torch.device("cpu")

    def synchronize(self, device=None):
        pass  # CPU tensors and completed gloo requests: nothing is in flight

    def is_available(self):
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)


class CPUTorch:
    """``torch`` for a megatron-core module that allocates on CUDA: everything is the
    real torch, except ``cuda.current_device()`` (the CPU), ``cuda.synchronize()`` (a
    no-op) and the tensor factories, where ``device="cuda"`` (or ``"cuda:N"``, or a
    CUDA ``torch.device``) means the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like",
                  "ones_like", "empty_like")

    def __init__(self):
        self.cuda = _CPUCuda(torch.cuda)

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in self._FACTORIES:
            return _on_cpu(value)
        return value


def _on_cpu(factory):
    def call(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    call.__name__ = getattr(factory, "__name__", "factory")
    return call


def manual_seed(seed: int) -> None:
    """Seed the CPU generator and Megatron's RNG tracker the way
    ``model_parallel_cuda_manual_seed`` does on a GPU (tensor-parallel rank 0)."""
    from megatron.core.tensor_parallel import random

    torch.manual_seed(seed)
    tracker = random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


@contextlib.contextmanager
def megatron_cpu(seed: int = 1234, *, pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size=None):
    """Set up megatron-core on the CPU; undo it all on exit.

    Initializes ``torch.distributed`` (gloo, world size 1, a ``file://`` rendezvous
    in a fresh temp directory) unless it is already initialized, Megatron's
    model-parallel groups (tensor size 1; pipeline size
    ``pipeline_model_parallel_size``, default 1, which must divide the world size;
    ``virtual_pipeline_model_parallel_size`` chunks per stage, default ``None``)
    unless already initialized, the CPU RNG tracker, memory buffer and
    :class:`CPUTorch` for the pipeline schedules. On exit, restores every replaced
    name and destroys what it created (and only that).

    For pipeline parallelism, initialize the process group (gloo, every rank) first.

    Raises:
        RuntimeError: naming the megatron-core attributes that are missing (see
            :data:`PATCHED_NAMES`).
    """
    missing = missing_names()
    if missing:
        raise RuntimeError("megatron_shim: megatron-core no longer has " + ", ".join(missing)
                           + "; update tests/megatron_shim.py for this release.")
    import torch.distributed as dist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random

    undo = contextlib.ExitStack()
    with undo:
        if not dist.is_initialized():
            tmp = tempfile.mkdtemp(prefix="megatron_shim_")
            dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rdzv"),
                                    rank=0, world_size=1)
            undo.callback(_rmdir, tmp)
            undo.callback(dist.destroy_process_group)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                1, pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
            undo.callback(parallel_state.destroy_model_parallel)

        for name in CPU_TORCH_MODULES:
            module = importlib.import_module(name)
            undo.callback(setattr, module, "torch", module.torch)
            module.torch = CPUTorch()

        saved = {name: getattr(random, name) for name in (
            "_get_cuda_rng_state", "_set_cuda_rng_state", "_CUDA_RNG_STATE_TRACKER",
            "_CUDA_RNG_STATE_TRACKER_INITIALIZED")}
        undo.callback(lambda: [setattr(random, k, v) for k, v in saved.items()])
        random._get_cuda_rng_state = _cpu_get_rng_state
        random._set_cuda_rng_state = _cpu_set_rng_state
        random._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

        saved_buffer = parallel_state._GLOBAL_MEMORY_BUFFER
        undo.callback(setattr, parallel_state, "_GLOBAL_MEMORY_BUFFER", saved_buffer)
        parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_buffer_class()()

        manual_seed(seed)
        yield


def _rmdir(path):
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)
