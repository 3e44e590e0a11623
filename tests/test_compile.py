"""torch.compile: the outer saved-tensor hooks see the compiled regions' saved tensors.

A compiled forward runs as one ``autograd.Function`` (AOTAutograd's
``CompiledFunction``) whose ``ctx.save_for_backward`` goes through the saved-tensor
hooks active when it *runs*, so ``with offloader:`` or :meth:`Offloader.attach`
around a compiled model offloads what the compiled graph saves. What is saved is
chosen by the partitioner (it may recompute cheap ops in backward), so the bytes
differ from eager; gradients are compared with the same compiled model run without
offloading. Kept tiny: compiling on a CPU takes seconds per graph.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ssdtrain
from helpers import assert_same

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS, WIDTH = 512, 256  # one activation: 512 KiB in fp32
SMALL = dict(min_tensor_bytes="64KiB", keep_tail_bytes=0)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.l1 = nn.Linear(WIDTH, WIDTH)
            self.l2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))).square().mean()


def _step(call, model, x, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = call(x)
    else:
        with ctx:
            loss = call(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def x():
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("how", ["attach_compiled", "attach_then_compile", "module_compile",
                                 "with_block"])
def test_compiled_model_is_exact_and_offloads(make_offloader, x, how, fullgraph):
    model = Tiny()
    if how == "module_compile":
        model.compile(fullgraph=fullgraph)  # compiles the module's own call, hooks included
        call = model
    else:
        call = torch.compile(model, fullgraph=fullgraph)
    ref = _step(call, model, x)  # compiled, no offloading
    off = make_offloader(**SMALL)
    ctx = None
    if how == "attach_compiled":
        off.attach(call)  # the OptimizedModule torch.compile returned
    elif how in ("attach_then_compile", "module_compile"):
        off.attach(model)  # hooks on the original module, which the compiled call runs
    else:
        ctx = off
    for _ in range(2):
        assert_same(ref, _step(call, model, x, ctx))
    off.wait()
    s = off.stats()
    # The compiled graph's saved activations went through ssdtrain's pack hook and
    # were written: with no outer hooks applied to compiled regions this is 0.
    assert s.offloaded_bytes >= 2 * ROWS * WIDTH * 4, s.summary()
    assert s.records_written >= 2 and s.prefetch_misses == 0
    if how != "with_block":
        assert off._attachments[0].passes == 2
    assert off.live_records() == 0


def test_compiled_eval_and_no_grad_calls_do_not_offload(make_offloader, x):
    model = Tiny()
    call = torch.compile(model)
    off = make_offloader(**SMALL)
    off.attach(call)
    with torch.no_grad():
        call(x)
    model.eval()
    call(x)
    assert off._attachments[0].passes == 0 and off.stats().packed_bytes == 0
