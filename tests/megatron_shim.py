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

Everything else is real megatron-core: process groups (gloo, world size 1), layers,
the loss. Parameters are created on the CPU with ``use_cpu_initialization=True``.

:func:`megatron_cpu` sets all of it up and undoes it; :data:`PATCHED_NAMES` lists the
megatron-core names this module replaces, so a canary test can say which one went
away in a new release.

This is test support, not part of ssdtrain: ``examples/megatron_gpt.py`` imports it
to run on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import warnings

import torch

__all__ = ["PATCHED_NAMES", "megatron_cpu", "manual_seed", "missing_names"]

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
)


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
def megatron_cpu(seed: int = 1234):
    """Set up megatron-core on the CPU for a world of one rank; undo it all on exit.

    Initializes ``torch.distributed`` (gloo, a ``file://`` rendezvous in a fresh temp
    directory) unless it is already initialized, Megatron's model-parallel groups
    (tensor and pipeline size 1), the CPU RNG tracker and memory buffer. On exit,
    restores every replaced name and destroys what it created (and only that).

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
            parallel_state.initialize_model_parallel(1, 1)
            undo.callback(parallel_state.destroy_model_parallel)

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
