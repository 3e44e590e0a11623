"""The estimate's forward on fake tensors: the meta-built model and its inputs turned
fake (:func:`fakeify`), and the forward run as an eager training step runs it
(:func:`_eager_hints`, NOTE [ Eager, not tracing ]), its operators' failures not logged
twice.

NOTE [ Why fake tensors and not plain meta tensors ]
Meta tensors have storages and ``_cdata`` identity, so the dedup logic works on
them, but operators that pick a kernel by device pick differently on ``meta``:
``scaled_dot_product_attention`` on a meta tensor takes the math path and saves the
(batch, heads, seq, seq) attention probabilities, where the CPU (and CUDA) flash
kernels save only q, k, v, the output and a logsumexp. A ``FakeTensor`` whose
device is ``cpu`` runs the meta kernels but dispatches like a CPU tensor, so the
tensors autograd saves are the ones a real CPU run saves. The model is still built
under ``torch.device("meta")`` (building directly under ``FakeTensorMode`` breaks
``module.to(dtype)``, which swaps parameters and refuses fake ones) and converted.

NOTE [ Eager, not tracing ]
Two libraries treat fake tensors as a sign of graph capture and change what runs;
the estimate undoes both for the forward it measures, so that it runs what an eager
training step runs:

* transformers' ``is_tracing`` counts a ``FakeTensor`` as tracing and then
  materialises the causal mask (and drops SDPA's native GQA) where eager passes
  ``is_causal=True`` with no mask: the estimate would count a (batch, 1, seq, seq)
  mask per layer that the real run never saves. ``is_fake_tensor`` is patched to
  answer ``False`` while the estimate's forward runs. Eager then asks one question of
  values, whether the position ids pack several sequences into a row
  (``masking_utils.find_packed_sequence_indices``); the estimate's inputs never do, so
  it answers "no" (``None``) as eager would.
  Eager also asks whether a padding mask is all ones (``masking_utils.fast_all``, to
  skip the mask): the estimate's rows have no padding, so it answers yes.
  ``PreTrainedModel.warn_if_padding_and_no_attention_mask`` asks whether a row ends
  in padding only to log a warning: it is skipped.
* the meta kernel of ``aten._grouped_mm`` (MoE experts) checks the CUDA kernel's
  dtype rule (bf16 only), while the CPU kernel takes any float dtype; on a non-bf16
  input the estimate computes the grouped matmul in bf16 and casts the result back.
  Only the output's shape and dtype matter, and autograd (which decides what is
  saved) sees the original call.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["fakeify"]


def fakeify(model: torch.nn.Module, inputs, mode, device="cpu"):
    """Turn the meta tensors of ``model`` (parameters, buffers, plain tensor attributes)
    and of ``inputs`` into fake tensors on ``device`` in place; returns the new inputs.

    Tied parameters stay one object; views keep sharing their storage."""
    from torch._subclasses.fake_tensor import FakeTensor
    conv = mode.fake_tensor_converter
    dev = torch.device(device)
    params = {}

    def fake(t):
        if isinstance(t, FakeTensor):
            return t
        if t.device.type == "meta":
            return conv.from_meta_and_device(mode, t, dev)
        return mode.from_tensor(t)

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            new = params.get(id(p))
            if new is None:
                new = params[id(p)] = (p, torch.nn.Parameter(fake(p.detach()),
                                                             requires_grad=p.requires_grad))
            module._parameters[name] = new[1]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b)
        for name, v in list(vars(module).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                setattr(module, name, fake(v))

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            return fake(obj)
        if isinstance(obj, tuple):
            return tuple(walk(o) for o in obj)
        if isinstance(obj, list):
            return [walk(o) for o in obj]
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        return obj
    return walk(inputs)


@contextlib.contextmanager
def _eager_hints():
    """NOTE [ Eager, not tracing ]: transformers must not take fake tensors for tracing."""
    import sys
    patches = []
    iu = sys.modules.get("transformers.utils.import_utils")
    if getattr(iu, "is_fake_tensor", None) is not None:
        patches.append((iu, "is_fake_tensor", lambda x: False))
    mu = sys.modules.get("transformers.masking_utils")
    if getattr(mu, "find_packed_sequence_indices", None) is not None:
        # Eager asks the position ids' values whether the rows pack several sequences;
        # the estimate's inputs never do (one sequence per row, positions 0..seq-1).
        patches.append((mu, "find_packed_sequence_indices", lambda position_ids: None))
    if getattr(mu, "fast_all", None) is not None:
        # Whether a padding mask is all ones (then SDPA runs is_causal with no mask): the
        # estimate's inputs are built on the meta device and carry no values; they stand
        # for rows with no padding, as above.
        patches.append((mu, "fast_all", lambda tensor: True))
    mu = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(mu, "PreTrainedModel", None)
    if getattr(pretrained, "warn_if_padding_and_no_attention_mask", None) is not None:
        # Only a warning, which asks the ids' values whether a row ends in padding; the
        # estimate's ids carry none, and what it decides is never saved.
        patches.append((pretrained, "warn_if_padding_and_no_attention_mask",
                        lambda self, input_ids, attention_mask: None))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        with _GroupedMMAnyDtype():
            yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch logs the whole traceback of an operator that fails on fake tensors before
    it raises; the exception itself reaches the caller (the CLI prints one line, or the
    traceback with --traceback), so the log would only say it twice, at length."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _GroupedMMAnyDtype(TorchDispatchMode):
    """NOTE [ Eager, not tracing ]: ``_grouped_mm`` on non-bf16 fake inputs, as the CPU
    kernel allows."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM and len(args) >= 2 and args[0].dtype != torch.bfloat16:
            dt = args[0].dtype
            a, b = args[0].to(torch.bfloat16), args[1].to(torch.bfloat16)
            return func(a, b, *args[2:], **kwargs).to(dt)
        return func(*args, **kwargs)


_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def _call(model, inputs):
    """``model`` called with ``inputs``: a dict as keywords, a tuple or list as positional
    arguments, anything else as the one argument."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
