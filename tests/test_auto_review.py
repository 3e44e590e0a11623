"""Counterexamples hunted in the default policy, ``"auto"`` (NOTE [ The offload quota ]
in ssdtrain/_auto.py), and regression tests of what held up: exactness across its step
transitions, passes that are not training steps, and the memory floor once the hooks
are off (step 5)."""

from __future__ import annotations

import torch

import models
import ssdtrain
from helpers import assert_grads_equal, grads
from loopback_helpers import LoopbackDevice, SaveForBackward, attach
from ssdtrain._auto import BASELINE_STEPS, SIZING_STEPS

KiB = 1 << 10
WARMUP = SIZING_STEPS + BASELINE_STEPS
SMALL = dict(min_tensor_bytes="8KiB", keep_tail_bytes=0)


def FAST(n):
    """A disk probe of 1 TB/s: a quota > 0."""
    return n / 1e12, n / 1e12


def SLOW(n):
    """A disk probe of 1 kB/s: quota 0, and the hooks off after the baseline."""
    return n / 1e3, n / 1e3


def test_evaluation_passes_under_no_grad_are_not_steps_of_the_quota(spill_dir):
    """A ``with off:`` forward under ``torch.no_grad()`` (evaluation through the same
    code path as training) saves nothing. Counted as a step of ``"auto"``, its S of 0
    set the next training step's quota to 0, and its short time became the baseline
    step time against which every writing step then read as slowed: on a disk fast
    enough for everything, with an evaluation pass after each training step, no
    training step offloaded anything. Such a pass is not a step (attach() already opens
    none for it): the training steps get their quota, gradients stay exact."""
    model, inputs = models.gpt()
    ref_model, _ = models.gpt()
    ref_model.load_state_dict(model.state_dict())
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), **SMALL)
    assert off.config.policy == "auto"
    off._auto._probe = FAST
    written = []
    try:
        for step in range(WARMUP + 2):
            for m in (model, ref_model):
                m.zero_grad(set_to_none=True)
            before = off.stats().offloaded_bytes
            with off:
                loss = model(*inputs)
            loss.backward()
            ref_model(*inputs).backward()
            assert_grads_equal(grads(ref_model), grads(model))
            written.append(off.stats().offloaded_bytes - before)
            model.eval()
            with torch.no_grad(), off:       # evaluation, as a user's loop may do it
                model(*inputs)
            model.train()
    finally:
        off.close()
    assert written[0] > 0 and written[SIZING_STEPS:WARMUP] == [0] * BASELINE_STEPS, written
    assert all(w > 0 for w in written[WARMUP:]), written
