"""torch.func transforms inside `with offloader:` (docs/guide.md, Failure behaviour)."""

import pytest
import torch


def test_torch_func_refusal_gets_a_note(make_offloader):
    """torch.func.grad refuses saved-tensor hooks with torch's own error; ssdtrain says
    what to do about it (docs/guide.md, Failure behaviour)."""
    off = make_offloader()
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="saved tensor hooks") as info:
        with off:
            torch.func.grad(lambda v: (v.sin() * v).sum())(x)
    assert any("outside the block" in n for n in getattr(info.value, "__notes__", []))
    assert not off.in_forward
