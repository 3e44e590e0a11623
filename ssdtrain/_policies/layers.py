"""A model's layers and a layer's buffers: which modules are the layers
(:func:`default_layers`), the tensors in a call's arguments, and a layer's buffers (their
slots, their state, which of them a forward updated: NOTE [ Recompute without a second
update ] in _policies/adaptive.py)."""

from __future__ import annotations

import torch

__all__ = ["default_layers", "buffer_slots", "buffer_state", "updated_buffers"]


def default_layers(model: torch.nn.Module):
    """``(qualified name, module)`` of every child of every ``nn.ModuleList`` in ``model``.

    Nested lists contribute their innermost children only (a list of lists of
    blocks gives the blocks).
    """
    found, seen = [], set()

    def walk(prefix, module, in_list):
        for name, child in module.named_children():
            qual = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.ModuleList):
                walk(qual, child, True)
            elif in_list:
                if id(child) not in seen:
                    seen.add(id(child))
                    found.append((qual, child))
            else:
                walk(qual, child, False)

    walk("", model, isinstance(model, torch.nn.ModuleList))
    return found


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _first_grad_tensor(obj):
    for t in _tensors(obj):
        if t.requires_grad:
            return t
    return None


def buffer_slots(module: torch.nn.Module):
    """``(qualified name, owner, local name)`` of every buffer of ``module`` (itself
    included), in registration order."""
    out = []
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None:
                out.append((f"{prefix}.{name}" if prefix else name, m, name))
    return out


def _version(t):
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (nor can change)
        return None


def buffer_state(module: torch.nn.Module, clone=False):
    """What :func:`updated_buffers` compares: per buffer slot ``(qualified name, owner,
    local name, tensor, version, clone)``.

    Args:
        module: the layer.
        clone: ``True`` (every buffer), ``False`` (none), or a predicate on the
            qualified name: which buffers to copy (a buffer shared by two slots is
            copied once). A copy is compared by value: kernels such as batch norm's
            update running statistics without bumping the version counter.
    """
    out, copies = [], {}
    for q, m, n in buffer_slots(module):
        t = m._buffers[n]
        c = None
        if clone is True or (callable(clone) and clone(q)):
            c = copies.get(id(t))
            if c is None:
                c = copies[id(t)] = t.detach().clone()
        out.append((q, m, n, t, _version(t), c))
    return out


def updated_buffers(state, known=()):
    """The qualified names of the buffers of a :func:`buffer_state` that were updated
    since: those in ``known`` (not compared: a value comparison waits for the
    device), and those replaced by another tensor, modified in place (version
    counter), or, where copied, holding another value."""
    out = []
    for q, m, n, t, v, c in state:
        now = m._buffers.get(n)
        if q in known or now is not t or _version(now) != v or (
                c is not None and not (c.shape == now.shape and c.dtype == now.dtype and
                                       torch.equal(c, now))):
            out.append(q)
    return out
