"""``ssdtrain check``: is ssdtrain exact on *my* model? One training step, with and without.

The bug users of activation offloading hit most is silent gradient corruption (a
stream race, a view rebuilt at the wrong offset, a stale buffer): nothing raises and
the loss still goes down. ssdtrain is exact by design (INV-EXACT, docs/ARCHITECTURE.md);
this tool lets a user see it on their own model, with their own inputs, on their own
machine::

    ssdtrain check --hf-config path/to/config.json --seq 512
    ssdtrain check --factory mypkg.models:make --device cuda

or, for a model and batch in hand::

    from ssdtrain.check import check_model
    result = check_model(model, batch)          # batch: a tensor, tuple or dict
    print(result.report()); assert result.exact

How it decides (NOTE [ Reference spread ]): two reference steps without ssdtrain and
one step with ssdtrain forcing every eligible saved tensor through the spill tier, each
from the same state (NOTE [ What a check restores ]); the loss, every gradient, every
buffer, every tensor a module holds and the RNG states after the step are compared
bitwise. Only when that does not come out exact are more reference steps run, to tell
the model's own run-to-run noise from ssdtrain.

Verdicts and the command's exit status: ``EXACT`` 0; ``MISMATCH`` 1 (or ``FAILED`` 1:
the step with ssdtrain raised where the steps without it ran); 2 a usage error, or the
factory or the model failed by itself (an exception, ``sys.exit``); ``NONDETERMINISTIC``
3 (the model varies from step to step without ssdtrain, and the step with ssdtrain is
within that variation); 130 interrupted.

This package: the two entry points, :func:`check_model` and :func:`main` (the command),
are here; their parts are in compare.py (the reference steps against the step with
ssdtrain, NOTE [ Reference spread ]), result.py (:class:`CheckResult`, the exit
statuses), snapshot.py (NOTE [ What a check restores ]), step.py (one training step and
what it gives to compare) and cli.py (the command line around the check).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
import traceback
from typing import Callable, Optional, Tuple

import torch

from .._config import OffloadConfig
from .._errors import ConfigError
from .cli import (_Failure, _StdoutToStderr, _UsageError, _build, _factory, _fail, _device,
                  _message, _parser, _users_code)
from .compare import MARGIN, REFERENCE_STEPS, Mismatch, Varying, _Reference
from .result import (EXIT_EXACT, EXIT_INTERRUPTED, EXIT_MISMATCH, EXIT_NONDETERMINISTIC,
                     EXIT_USAGE, CheckResult)
from .snapshot import _Snapshot
from .step import _step

__all__ = ["check_model", "CheckResult", "Mismatch", "Varying", "main",
           "REFERENCE_STEPS", "MARGIN", "EXIT_EXACT", "EXIT_MISMATCH", "EXIT_USAGE",
           "EXIT_NONDETERMINISTIC", "EXIT_INTERRUPTED"]


# ------------------------------------------------------------------------ the check
def _forcing_offloader(spill_dir: Optional[str], overrides: dict):
    """The default offloader of a check: every eligible tensor through the spill tier
    (the static policy, ``min_tensor_bytes=0``, ``keep_tail_bytes=0``), on ``spill_dir``
    or a temporary folder: ``(offloader, the folder to remove or None)``."""
    import ssdtrain

    own_dir = None
    if spill_dir is None:
        spill_dir = own_dir = tempfile.mkdtemp(prefix="ssdtrain-check-")
    fields = dict(policy="static", min_tensor_bytes=0, keep_tail_bytes=0)
    fields.update(overrides)
    try:
        return ssdtrain.Offloader(OffloadConfig(spill_dir=spill_dir, **fields)), own_dir
    except BaseException:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        raise


def check_model(model: torch.nn.Module, inputs, *, loss_fn: Optional[Callable] = None,
                offloader=None, spill_dir: Optional[str] = None, **overrides) -> CheckResult:
    """Run one training step of ``model`` on ``inputs`` without ssdtrain and with it.

    Two reference steps without ssdtrain and one with it, each from the state the model
    was found in; when they are not all bitwise equal, reference steps until there are
    :data:`REFERENCE_STEPS` (8), to tell the model's own noise from ssdtrain's
    (NOTE [ Reference spread ], docs/check.md).

    Args:
        model: the module, on the device to check (its mode is kept: call ``train()``
            first for a training step).
        inputs: what ``model`` is called with: a tuple or list (positional), a dict
            (keywords), anything else (one argument).
        loss_fn: ``output -> scalar loss``; default: the output itself when it is a
            0-dim tensor, or its ``.loss`` (Hugging Face models given ``labels``).
        offloader: an :class:`~ssdtrain.Offloader` to check (its configuration as is;
            the caller owns it). Default: a fresh one on ``spill_dir`` that forces every
            eligible tensor to the spill tier (``min_tensor_bytes=0``,
            ``keep_tail_bytes=0``), closed at the end.
        spill_dir: for the default offloader; default a temporary folder.
        **overrides: more :class:`~ssdtrain.OffloadConfig` fields for the default offloader.

    Returns:
        A :class:`CheckResult`: ``verdict`` is ``"exact"``, ``"mismatch"``, ``"failed"``
        (the step with ssdtrain raised an exception the steps without it did not) or
        ``"nondeterministic"``. The model is left as it was found (NOTE [ What a check
        restores ]), whatever happens.

    Raises:
        ConfigError: ``model`` is not a module, has no parameter that requires grad or
            lazy parameters not yet materialized, the loss is not a scalar that requires
            grad, or the offloader's configuration is refused.
        Exception: whatever the model raises in a step without ssdtrain, as it is.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"ssdtrain check: the model must be a torch.nn.Module, got "
                          f"{type(model).__name__}.")
    if offloader is not None and (spill_dir is not None or overrides):
        raise ConfigError("ssdtrain check: got an offloader and config fields; configure the "
                          "offloader you pass, or pass only the fields.")
    params = list(model.parameters())
    if any(torch.nn.parameter.is_lazy(t) for t in (*params, *model.buffers())):
        raise ConfigError("ssdtrain check: the model has lazy parameters not yet materialized "
                          "(torch.nn.Lazy* modules); run one forward on the inputs before "
                          "checking it.")
    if not any(p.requires_grad for p in params):
        raise ConfigError(f"ssdtrain check: {type(model).__name__} has no parameter that "
                          f"requires grad ({len(params)} parameters), so a training step has "
                          f"no backward to check; give a model with trainable parameters.")
    device = params[0].device
    snapshot = _Snapshot(model, inputs, device)
    own_dir = own_off = None
    reference = _Reference()
    t_ref = t_off = 0.0
    resident, error, got, stats = None, None, {}, {}

    def reference_step():
        nonlocal t_ref
        snapshot.restore()
        sample, seconds, _ = _step(model, inputs, loss_fn, device)
        reference.add(sample)
        if reference.steps == 2:  # the first warms up kernels and caches
            t_ref = seconds

    try:
        if offloader is None:
            offloader, own_dir = _forcing_offloader(spill_dir, overrides)
            own_off = offloader
        reference_step()
        reference_step()
        before = offloader.stats()
        snapshot.restore()
        try:
            got, t_off, resident = _step(model, inputs, loss_fn, device, offloader)
        except Exception as e:  # the same step ran without ssdtrain: this one is ssdtrain's
            error = f"{type(e).__name__}: {e}"
        try:
            offloader.wait()
        except Exception as e:
            error = error or f"{type(e).__name__}: {e}"
        stats = dataclasses.asdict(offloader.stats().since(before))
        stats["resident_at_backward_bytes"] = resident
        if error is None and not reference.agrees(got):
            while reference.steps < REFERENCE_STEPS:
                reference_step()
    finally:
        snapshot.restore()
        if own_off is not None:
            own_off.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)

    mismatches, varying = [], []
    if error is None:
        mismatches, varying = reference.compare(got)
        order = {"loss": 0, "gradient": 1, "buffer": 2, "attribute": 3, "rng": 4}
        position = {k: i for i, k in enumerate(reference.order)}
        mismatches.sort(key=lambda m: (order[m.kind], position.get((m.kind, m.name), 0)))
    deterministic = reference.deterministic
    exact = error is None and deterministic and not mismatches
    return CheckResult(
        exact=exact, deterministic=deterministic,
        compared="bitwise" if deterministic else
        f"bitwise where {reference.steps} steps without ssdtrain agree, else within "
        f"{MARGIN:g}x their spread",
        tensors_compared=len(reference.order), mismatches=mismatches, error=error,
        stats=stats, reference_seconds=t_ref, ssdtrain_seconds=t_off, device=str(device),
        references=reference.steps, varying=varying,
        kinds={kind: sum(1 for k, _ in reference.order if k == kind) for kind in
               ("loss", "gradient", "buffer", "attribute", "rng")})


# ------------------------------------------------------------------------ the command
def _run(a) -> Tuple[str, CheckResult]:
    for name in ("batch", "seq"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise _Failure(EXIT_USAGE, "usage", f"--{name} must be >= 1, got {v}.")
    device = _device(a)
    if device.type == "cuda":  # deterministic kernels where they exist, before cuBLAS starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:  # before the user's code runs: a refused --engine or --spill-dir fails fast
        offloader, own_dir = _forcing_offloader(a.spill_dir,
                                                {"engine": a.engine} if a.engine else {})
    except (ConfigError, TypeError, ValueError) as e:
        raise _Failure(EXIT_USAGE, "usage", f"{_message(e)} (the offloader of --engine, "
                       f"--spill-dir)") from None
    try:
        model, inputs = _build(a, _factory(a), device)
        try:
            return type(model).__name__, check_model(model, inputs, offloader=offloader)
        except ConfigError as e:
            raise _Failure(EXIT_USAGE, "model", _message(e)) from None
        except KeyboardInterrupt:
            raise
        except Exception:
            raise _users_code("model", "the model", " in a step without ssdtrain",
                              "It fails by itself, so there is nothing to compare: fix the "
                              "model or its inputs (--traceback shows where).") from None
        except BaseException:
            raise _users_code("model", "the model", " during the check",
                              "A model must return from forward and backward to be checked "
                              "(--traceback shows where).") from None
    finally:
        offloader.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def main(argv=None, prog="ssdtrain check") -> int:
    """The ``ssdtrain check`` command; returns the exit status, 0 only when exact.

    What the factory and the model print goes to stderr; stdout carries only the
    report, or with ``--json`` only one JSON document, on success and failure alike.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    out = sys.stdout
    want_json = "--json" in argv
    p = _parser(prog)
    a = None
    try:
        try:
            a = p.parse_args(argv)
        except _UsageError as e:
            raise _Failure(EXIT_USAGE, "usage", str(e)) from None
        except SystemExit as e:  # --help printed: argparse's own exit
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        with _StdoutToStderr():
            name, result = _run(a)
    except _Failure as f:
        return _fail(f, p, out, want_json, a is not None and a.traceback)
    except KeyboardInterrupt:
        return _fail(_Failure(EXIT_INTERRUPTED, "interrupted",
                              "interrupted (KeyboardInterrupt): no verdict. The model was left "
                              "as it was found."), p, out, want_json, False)
    except Exception as e:  # check's own code, outside the user's and the step with ssdtrain
        return _fail(_Failure(EXIT_MISMATCH, "ssdtrain",
                              f"ssdtrain check itself failed: {type(e).__name__}: {e}. Please "
                              f"report it, with the output of --traceback.",
                              traceback.format_exc()), p, out, want_json,
                     a is not None and a.traceback)
    if want_json:
        print(json.dumps(result.to_json(), indent=2, allow_nan=False), file=out)
    else:
        print(f"ssdtrain check: {name} on {result.device}", file=out)
        print(result.report(), file=out)
    out.flush()
    return result.exit_status
