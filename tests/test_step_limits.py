"""A step's limits (``StepLimits`` in ssdtrain/_decision/policy.py): fixed before its pass opens,
handed to the store with the pass, and replaced whole by the next pass's."""

import pytest
import torch
from helpers import SaveForBackward

from ssdtrain import testing
from ssdtrain._decision.policy import NO_LIMITS, StepLimits

N = 64 << 10  # bytes per record


@pytest.mark.parametrize("bad", [dict(quota=-1), dict(quota=1.5), dict(quota=True),
                                 dict(floor=None), dict(floor=-4), dict(write_behind="1"),
                                 dict(window=-1)])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError, match="StepLimits"):
        StepLimits(**bad)


def test_no_limits_is_a_step_without_any():
    assert NO_LIMITS == StepLimits() and NO_LIMITS.quota is None and NO_LIMITS.floor == 0
    with pytest.raises(AttributeError):
        NO_LIMITS.quota = 1  # frozen: a pass never sees a limit change under it


def _step(off, records=8):
    """One forward of ``records`` saves of N bytes each and its backward; the bytes the
    step decided to write."""
    before = off.stats().offloaded_bytes
    sink, anchor = [], torch.zeros((), requires_grad=True)
    with off:
        out = anchor
        for i in range(records):
            out = SaveForBackward.apply(out, sink, torch.full((N // 4,), float(i)))
    off.wait()
    out.backward()
    assert [s[0][0].item() for s in sink] == [float(i) for i in reversed(range(records))]
    return off.stats().offloaded_bytes - before


def test_each_pass_runs_under_the_limits_it_opened_with(make_offloader, monkeypatch):
    """A static offloader whose steps are given limits: a quota of three records writes
    the earliest three (the tail window keeps nothing under a quota); the next step,
    given none, is the tail window's again (the last two records kept); each pass's
    write-behind limit and prefetch window are the ones it opened with."""
    off = make_offloader(keep_tail_bytes=2 * N, write_behind_bytes=4 * N, prefetch_bytes=N,
                         min_tensor_bytes=4096)
    given = []
    monkeypatch.setattr(off._steps, "begin_step", lambda training: given.pop(0))
    given.append(StepLimits(quota=3 * N, write_behind=N, window=5 * N))
    assert _step(off) == 3 * N
    assert testing.step_limits(off).quota == 3 * N
    assert (testing.write_behind(off), testing.prefetch_window(off)) == (N, 5 * N)
    given.append(NO_LIMITS)
    assert _step(off) == 6 * N
    assert testing.step_limits(off) is NO_LIMITS
    assert (testing.write_behind(off), testing.prefetch_window(off)) == (4 * N, N)  # the config's
    given.append(StepLimits(quota=0))
    assert _step(off) == 0


def test_a_plans_write_behind_stands_until_a_step_gives_its_own(make_offloader, monkeypatch):
    """``limit_write_behind`` (an applied plan's) is the standing limit: steps without a
    limit of their own run under it, a step with one under its own, and the step after
    that under the standing one again."""
    off = make_offloader(keep_tail_bytes=0, write_behind_bytes=4 * N, min_tensor_bytes=4096)
    testing.limit_write_behind(off, 2 * N)  # as an applied plan does
    given = [NO_LIMITS, StepLimits(write_behind=7 * N), NO_LIMITS]
    monkeypatch.setattr(off._steps, "begin_step", lambda training: given.pop(0))
    seen = []
    for _ in range(3):
        _step(off, records=2)
        seen.append(testing.write_behind(off))
    assert seen == [2 * N, 7 * N, 2 * N]


def test_the_inspection_surface_takes_an_offloader_only(make_offloader):
    off = make_offloader()
    testing.check_invariants(off)
    assert testing.engine(off).name in ("native", "posix", "kvikio")
    assert testing.spill(off).files and testing.probe(off) is not None
    with pytest.raises(TypeError, match="expected an ssdtrain.Offloader, got int"):
        testing.check_invariants(3)


@pytest.mark.parametrize("policy", ["static", "auto", "adaptive"])
def test_each_policy_is_a_step_policy_type(make_offloader, policy):
    """NOTE [ Step policies ]: the Offloader holds one StepPolicy per config, and only
    "auto" has limits of its own; a pass with grad mode off gets none under any."""
    from ssdtrain._policies.steps import AdaptiveSteps, AutoSteps, StaticSteps, StepPolicy
    off = make_offloader(policy=policy, **({"memory_budget_bytes": 1 << 30}
                                           if policy == "adaptive" else {}))
    steps = off._steps
    assert isinstance(steps, StepPolicy)
    assert type(steps) is {"static": StaticSteps, "auto": AutoSteps,
                           "adaptive": AdaptiveSteps}[policy]
    assert (steps.controller is not None) == (policy == "auto")
    assert steps.controller is off._auto
    assert steps.begin_step(False) is NO_LIMITS
    if policy != "auto":
        assert steps.begin_step(True) is NO_LIMITS
        assert steps.intercepts and not steps.may_cut
    else:
        assert steps.training is False
