"""assert_same on a reference that does not reproduce (NOTE [ A reference that does not
reproduce ] in helpers.py): it passes only when the offloaded step equals a second
reference, and fails whenever the offloaded step is what differs."""

import pytest
import torch
from helpers import ReferenceNotReproduced, StepResult, assert_same, numerics_env, run_step
from models import ALL_MODELS


def _nudged(result, name):
    """``result`` with one element of ``name`` (``loss`` or a parameter) one ulp off."""
    loss, grads = result
    grads = dict(grads)
    if name == "loss":
        loss = torch.nextafter(loss, loss + 1)
    else:
        g = grads[name].clone()
        g.view(-1)[0] = torch.nextafter(g.view(-1)[0], g.view(-1)[0] + 1)
        grads[name] = g
    return StepResult(loss, grads, getattr(result, "env", None), getattr(result, "again", None))


@pytest.fixture
def step():
    torch.manual_seed(0)
    model, inputs = ALL_MODELS["tied"]()
    return run_step(model, inputs)


def test_a_reference_is_a_step_that_runs_again_bitwise(step):
    assert step.env == numerics_env()
    again = step.again()
    assert again.again is not None
    assert_same(step, again)


@pytest.mark.parametrize("name", ["loss", "emb.weight"])
def test_an_odd_reference_passes_when_the_step_equals_a_second_one(step, name):
    odd = _nudged(step, name)  # the first reference ran in a state that did not last
    with pytest.warns(ReferenceNotReproduced, match="did not reproduce.*bitwise equal"):
        assert_same(odd, step.again())


@pytest.mark.parametrize("name", ["loss", "mix.bias"])
def test_a_step_that_differs_from_a_reproducible_reference_fails(step, name):
    with pytest.raises(AssertionError, match="is bitwise equal to the reference"):
        assert_same(step, _nudged(step.again(), name))


def test_a_step_that_equals_neither_reference_fails(step):
    odd = _nudged(step, "loss")
    with pytest.raises(AssertionError, match="differs from the reference too.*mix.bias"):
        assert_same(odd, _nudged(step.again(), "mix.bias"))


def test_the_warning_names_what_changed_in_the_process(step):
    odd = StepResult(*_nudged(step, "loss"), dict(step.env, threads=step.env["threads"] + 7),
                     step.again)
    with pytest.warns(ReferenceNotReproduced, match=r"threads \d+ -> \d+"):
        assert_same(odd, step.again())
