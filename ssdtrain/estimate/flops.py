"""The estimate's FLOP count: a forward of its own on fake tensors under
``FlopCounterMode`` (:func:`_count_flops`), with the formulas the counter lacks
(:func:`_extra_flop_formulas`: MoE grouped matmuls, the CPU attention kernel)."""

from __future__ import annotations

import torch

from .._policies.layers import default_layers
from .fake import _GROUPED_MM, _call, _eager_hints, _quiet_fake_tensor_log, fakeify


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    """Each output element of a grouped matmul is one dot product of length K."""
    n = 1
    for d in out_shape:
        n *= d
    return 2 * n * a_shape[-1]


def _sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
    """torch's count for its CUDA attention kernels (``sdpa_flop_count``)."""
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q_shape, k_shape, v_shape)


_CPU_SDPA = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu",
                            None), "default", None)


def _extra_flop_formulas():
    """FLOP formulas ``FlopCounterMode`` lacks: MoE grouped matmuls (torch's, and the
    fallback transformers registers when it cannot use torch's), and the CPU kernel of
    ``scaled_dot_product_attention`` (torch counts its CUDA kernels only: on this
    machine the estimate left attention out, about 14% of a Llama-3-8B forward at
    sequence 4096). Attention is counted as torch counts its CUDA kernels: the two
    batched matmuls, the causal mask not discounted."""
    out = {}
    if _CPU_SDPA is not None:
        out[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flops
    if _GROUPED_MM is not None:
        out[torch.ops.aten._grouped_mm] = _grouped_mm_flops
    try:
        out[torch.ops.transformers.grouped_mm_fallback] = _grouped_mm_flops
    except (AttributeError, RuntimeError):
        pass
    return out

def _count_flops(build, device, layers=None):
    """Forward FLOPs of a model built anew, on fake tensors, with no saved-tensor hooks:
    ``(total, [per block])``, the blocks named as in :func:`measure`.

    A forward of its own: ``FlopCounterMode`` decomposes operators it has no formula
    for and tracks modules, which changes which tensors live how long (a saved tensor
    the real run frees during forward lived on under it), so the pass whose bytes are
    measured must not run under it. A block's FLOPs are the counter's total after its
    forward minus before it (forward hooks; a block called twice counts both calls),
    so the blocks and what lies outside them add up to the total."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):
        model, inputs = build()
    inputs = fakeify(model, inputs, mode, device)
    counter = FlopCounterMode(display=False, custom_mapping=_extra_flop_formulas())
    named = list((layers or default_layers)(model))
    per_layer = [0.0] * len(named)
    open_at = {}
    hooks = []
    for i, (_, module) in enumerate(named):
        def pre(mod, args, i=i):
            open_at.setdefault(i, []).append(counter.get_total_flops())

        def post(mod, args, output, i=i):
            per_layer[i] += counter.get_total_flops() - open_at[i].pop()
        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))
    out = None
    try:
        with mode, _eager_hints(), _quiet_fake_tensor_log(), counter:
            out = _call(model, inputs)
    finally:
        del out
        for h in hooks:
            h.remove()
    return float(counter.get_total_flops()), [float(f) for f in per_layer]
