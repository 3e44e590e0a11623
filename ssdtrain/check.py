"""``ssdtrain check``: is ssdtrain exact on *my* model? One training step, three times.

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

How it decides:

1. Two reference steps without ssdtrain, from the same parameters, buffers and RNG
   state: whether the model itself is deterministic here.
2. One step with ssdtrain forcing every eligible saved tensor through the spill tier
   (``min_tensor_bytes=0``, ``keep_tail_bytes=0``, and forward waits for every write
   before backward starts, so backward reads each record back from disk).
3. Compared bitwise (``torch.equal``): the loss, every parameter's gradient, every
   buffer after the step (BatchNorm's running statistics...) and the RNG state after
   the step (ssdtrain must not draw random numbers). The first mismatch is named, with
   the largest absolute difference. When the two reference steps already differ, the
   model is not deterministic on this device, bitwise equality cannot be asked for,
   and each tensor is compared instead against the spread between the two reference
   steps (and the result says so).

The model is left as it was found (parameters, buffers, gradients, RNG state).
Exit status of the command: 0 exact; 1 a mismatch (or ssdtrain raised); 2 a usage
error; 3 the model is not deterministic here, so exactness could not be decided (the
ssdtrain step stayed within the model's own run-to-run spread).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ._config import OffloadConfig
from ._cuda import default_device, rng_state as _rng_state, set_rng_state as _set_rng_state
from ._cuda import synchronize as _sync
from ._errors import ConfigError, SSDTrainError

__all__ = ["check_model", "CheckResult", "Mismatch", "main"]

EXIT_EXACT, EXIT_MISMATCH, EXIT_USAGE, EXIT_UNDECIDED = 0, 1, 2, 3


@dataclasses.dataclass
class Mismatch:
    """One tensor that differs: ``kind`` is ``loss``, ``gradient``, ``buffer`` or ``rng``."""

    kind: str
    name: str
    max_abs_diff: float
    detail: str = ""

    def __str__(self):
        what = f"{self.kind} {self.name}" if self.name else self.kind
        return f"{what}: max abs diff {self.max_abs_diff:.6g}{' (' + self.detail + ')' if self.detail else ''}"


@dataclasses.dataclass
class CheckResult:
    """What :func:`check_model` found. ``exact`` is the verdict."""

    exact: bool
    deterministic: bool
    compared: str
    tensors_compared: int
    mismatches: List[Mismatch]
    error: Optional[str]
    stats: Dict[str, Any]
    reference_seconds: float
    ssdtrain_seconds: float
    device: str

    @property
    def exit_status(self) -> int:
        if self.exact:
            return EXIT_EXACT
        if self.error is None and not self.deterministic and not self.mismatches:
            return EXIT_UNDECIDED
        return EXIT_MISMATCH

    def report(self) -> str:
        mib = lambda n: f"{n / (1 << 20):.2f} MiB"  # noqa: E731
        s = self.stats
        lines = []
        if self.error is not None:
            lines.append(f"FAILED: the step with ssdtrain raised: {self.error}")
        elif self.exact:
            lines.append(f"EXACT: loss, {self.tensors_compared - 1} gradients, buffers and RNG "
                         f"state are bitwise equal to the step without ssdtrain.")
        elif not self.deterministic and not self.mismatches:
            lines.append("UNDECIDED: the model is not deterministic on this device (two steps "
                         "without ssdtrain differ), so bitwise equality cannot be asked for; "
                         "every tensor with ssdtrain is within the spread of those two steps.")
        else:
            first = self.mismatches[0]
            lines.append(f"MISMATCH ({self.compared}): {len(self.mismatches)} of "
                         f"{self.tensors_compared} tensors differ; first: {first}")
            worst = max(self.mismatches, key=lambda m: m.max_abs_diff)
            if worst is not first:
                lines.append(f"  largest: {worst}")
        if not self.deterministic:
            lines.append("note: without ssdtrain the model itself gave different results in two "
                         "identical steps (a kernel with no deterministic variant?); compared "
                         "against that spread instead of bitwise. On CUDA try "
                         "torch.use_deterministic_algorithms(True).")
        if s:
            lines.append(
                f"offloaded {mib(s['offloaded_bytes'])} of {mib(s['unique_bytes'])} saved "
                f"({s['records_written']} writes), read back {mib(s['bytes_read'])} "
                f"({s['records_read']} reads), kept in memory {mib(s['kept_bytes'])}; engine "
                f"{s['engine']}")
            held = s.get("resident_at_backward_bytes")
            if held is not None:
                lines.append(
                    f"memory: when backward started ssdtrain held {mib(held)} of the "
                    f"{mib(s['unique_bytes'])} saved (without it: all of them; saves "
                    f"{mib(max(0, s['unique_bytes'] - held))})")
        if self.reference_seconds > 0:
            lines.append(f"step time with ssdtrain {self.ssdtrain_seconds:.3f} s vs "
                         f"{self.reference_seconds:.3f} s without "
                         f"({self.ssdtrain_seconds / self.reference_seconds:.2f}x; every write "
                         f"waited for before backward, so slower than in training)")
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["exit_status"] = self.exit_status
        return json.loads(json.dumps(d, default=lambda o: None if isinstance(o, float) and
                                     not math.isfinite(o) else str(o)))


# ------------------------------------------------------------------------ one step
def _loss_of(out, loss_fn):
    if loss_fn is not None:
        return loss_fn(out)
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise ConfigError(f"ssdtrain check: the model returned {type(out).__name__}, not a scalar "
                      f"loss (a 0-dim tensor, or an output with a .loss); pass loss_fn= "
                      f"(output -> scalar loss).")


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _step(model, inputs, loss_fn, device, offloader=None):
    """One forward+backward: ``({key: tensor}`` of everything compared, seconds, bytes of
    saved tensors ssdtrain held in memory when backward started)."""
    model.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    resident = None
    with offloader if offloader is not None else contextlib.nullcontext():
        loss = _loss_of(_call(model, inputs), loss_fn)
        if offloader is not None:
            offloader.wait()  # every write ends before backward: backward reads from disk
            resident = offloader.resident_bytes()
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    out = {("loss", ""): loss.detach().clone()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[("gradient", name)] = p.grad.detach().clone()
    for name, b in model.named_buffers():
        out[("buffer", name)] = b.detach().clone()
    for key, value in _rng_state(device).items():
        out[("rng", key)] = value.clone()
    return out, seconds, resident


def _diff(a, b):
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        return float((a.long() - b.long()).abs().max().item()) if a.numel() else 0.0
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(d), d)
    return float(torch.nan_to_num(d, nan=math.inf).max().item())


def check_model(model: torch.nn.Module, inputs, *, loss_fn: Optional[Callable] = None,
                offloader=None, spill_dir: Optional[str] = None, **overrides) -> CheckResult:
    """Run one step of ``model`` on ``inputs`` without ssdtrain twice and with it once.

    Args:
        model: the module, on the device to check (its mode is kept: call ``train()``
            first for a training step).
        inputs: what ``model`` is called with: a tensor, a tuple (positional) or a dict
            (keywords).
        loss_fn: ``output -> scalar loss``; default: the output itself when it is a
            0-dim tensor, or its ``.loss`` (Hugging Face models given ``labels``).
        offloader: an :class:`~ssdtrain.Offloader` to check (its configuration as is;
            the caller owns it). Default: a fresh one on ``spill_dir`` that forces every
            eligible tensor to the spill tier (``min_tensor_bytes=0``,
            ``keep_tail_bytes=0``), closed at the end.
        spill_dir: for the default offloader; default a temporary folder.
        **overrides: more :class:`~ssdtrain.OffloadConfig` fields for the default offloader.

    Returns:
        A :class:`CheckResult`. The model's parameters, buffers, gradients and the RNG
        state are restored as they were on entry.
    """
    import ssdtrain

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"ssdtrain check: model must be a torch.nn.Module, got "
                          f"{type(model).__name__}.")
    if offloader is not None and (spill_dir is not None or overrides):
        raise ConfigError("ssdtrain check: got an offloader and config fields; configure the "
                          "offloader you pass, or pass only the fields.")
    try:
        device = next(iter(model.parameters())).device
    except StopIteration:
        device = torch.device("cpu")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: (None if p.grad is None else p.grad.detach().clone())
             for n, p in model.named_parameters()}
    rng = _rng_state(device)
    own_dir = own_off = None

    def restore():
        model.load_state_dict(state)
        _set_rng_state(rng, device)

    try:
        restore()
        ref1, _, _ = _step(model, inputs, loss_fn, device)  # also warms up kernels, caches
        restore()
        ref2, t_ref, _ = _step(model, inputs, loss_fn, device)
        deterministic = all(_diff(ref1[k], ref2[k]) == 0 for k in ref1) and ref1.keys() == ref2.keys()
        if offloader is None:
            if spill_dir is None:
                spill_dir = own_dir = tempfile.mkdtemp(prefix="ssdtrain-check-")
            # every tensor offloaded (the static policy): what is checked is the offload path
            fields = dict(policy="static", min_tensor_bytes=0, keep_tail_bytes=0)
            fields.update(overrides)
            offloader = own_off = ssdtrain.Offloader(OffloadConfig(spill_dir=spill_dir, **fields))
        before = offloader.stats()
        restore()
        error, got, t_off, resident = None, {}, 0.0, None
        try:
            got, t_off, resident = _step(model, inputs, loss_fn, device, offloader)
        except SSDTrainError as e:
            error = f"{type(e).__name__}: {e}"
        offloader.wait()
        stats = dataclasses.asdict(offloader.stats().since(before))
        stats["resident_at_backward_bytes"] = resident
    finally:
        restore()
        for n, p in model.named_parameters():
            p.grad = grads[n]
        if own_off is not None:
            own_off.close()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)

    mismatches = []
    if error is None:
        for key in ref1.keys() | got.keys():
            kind, name = key
            if key not in got or key not in ref1:
                mismatches.append(Mismatch(kind, name, math.inf,
                                           "missing with ssdtrain" if key not in got
                                           else "only with ssdtrain"))
                continue
            d = _diff(ref1[key], got[key])
            allowed = 0.0 if deterministic else _diff(ref1[key], ref2.get(key, ref1[key]))
            if d > allowed:
                detail = "" if deterministic else f"the model's own spread is {allowed:.6g}"
                mismatches.append(Mismatch(kind, name, d, detail))
        order = {"loss": 0, "gradient": 1, "buffer": 2, "rng": 3}
        names = [k for k in ref1]  # forward order of parameters, then buffers
        mismatches.sort(key=lambda m: (order[m.kind], names.index((m.kind, m.name))
                                       if (m.kind, m.name) in names else 0))
    exact = error is None and deterministic and not mismatches
    return CheckResult(exact=exact, deterministic=deterministic,
                       compared="bitwise" if deterministic else "within the reference's spread",
                       tensors_compared=len(ref1), mismatches=mismatches, error=error,
                       stats=stats, reference_seconds=t_ref, ssdtrain_seconds=t_off,
                       device=str(device))


# ------------------------------------------------------------------------ the command
def _parser(prog):
    p = argparse.ArgumentParser(
        prog=prog, description="Run one training step of a model without ssdtrain (twice) and "
        "with ssdtrain forcing every eligible saved tensor through the spill tier, and compare "
        "loss, gradients, buffers and RNG state bitwise. Exit 0 exact, 1 mismatch, 2 usage "
        "error, 3 undecided (the model is not deterministic here).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-config", metavar="PATH",
                     help="a Hugging Face config.json (or its folder): the model is built from it "
                          "with random weights (nothing downloaded)")
    src.add_argument("--factory", metavar="MODULE:FUNCTION",
                     help="a function returning (model, inputs), called with the keywords it "
                          "accepts of batch, seq, dtype (as in ssdtrain estimate)")
    p.add_argument("--batch", type=int, help="micro-batch size (default: the factory's, 1 for "
                                             "a config)")
    p.add_argument("--seq", type=int, help="sequence length (default: the factory's; 128 for "
                                           "a config)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (default: the factory's, float32 for a config)")
    p.add_argument("--device", help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--spill-dir", help="where spill files go (default: a temporary folder)")
    p.add_argument("--engine", help="OffloadConfig.engine (default auto)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--traceback", action="store_true",
                   help="show the full traceback when building or running the model fails")
    return p


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def main(argv=None, prog="ssdtrain check") -> int:
    """The ``ssdtrain check`` command; returns the exit status."""
    from .estimate import _factory_builder, _strip, hf_factory, load_factory

    p = _parser(prog)
    a = p.parse_args(argv)
    try:
        for name in ("batch", "seq"):
            v = getattr(a, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name} must be >= 1, got {v}.")
        device = torch.device(a.device) if a.device else default_device()
        if device.type == "cuda" and default_device().type != "cuda":
            raise ConfigError(f"--device {a.device}: torch {torch.__version__} sees no CUDA "
                              f"device here; use --device cpu.")
        if a.factory is not None:
            factory = load_factory(a.factory)
        else:
            factory = hf_factory(a.hf_config)
        seq = a.seq if a.seq is not None or a.factory is not None else 128
        build, _ = _factory_builder(factory, batch=a.batch, seq=seq,
                                    dtype=getattr(torch, a.dtype) if a.dtype else None,
                                    gradient_checkpointing=None)
        overrides = {"engine": a.engine} if a.engine else {}
    except ConfigError as e:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {_strip(e)}", file=sys.stderr)
        return EXIT_USAGE
    if device.type == "cuda":  # deterministic kernels where they exist, before cuBLAS starts
        import os
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.manual_seed(0)
        model, inputs = build()
        model, inputs = model.to(device), _to(inputs, device)
        result = check_model(model, inputs, spill_dir=a.spill_dir, **overrides)
    except ConfigError as e:
        print(f"{p.prog}: error: {_strip(e).removeprefix('ssdtrain check: ')}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the model's own code failed
        if a.traceback:
            raise
        print(f"{p.prog}: error: building or running the model failed: {type(e).__name__}: {e} "
              f"(--traceback shows where)", file=sys.stderr)
        return EXIT_MISMATCH
    if a.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"ssdtrain check: {type(model).__name__} on {result.device}")
        print(result.report())
    return result.exit_status
