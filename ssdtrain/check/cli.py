"""The parts of ``ssdtrain check`` the command line needs around :func:`check_model`:
the parser, stdout sent to stderr while the user's code runs, the factory's model and
inputs, and the failures that give no verdict, with their messages and exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import sys
import traceback

import torch

from .._device.cuda import default_device
from .._errors import ConfigError
from .result import EXIT_INTERRUPTED, EXIT_USAGE


class _UsageError(Exception):
    """A bad command line (argparse's ``error``, which would exit, raises this)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _parser(prog):
    p = _Parser(
        prog=prog, description="Run one training step of a model without ssdtrain and with "
        "ssdtrain forcing every eligible saved tensor through the spill tier, and compare "
        "loss, gradients, buffers, module tensors and RNG states bitwise. Exit 0 exact, 1 "
        "mismatch (or the step with ssdtrain failed), 2 usage error or the factory/model "
        "failed by itself, 3 nondeterministic (the model varies by itself), 130 interrupted. "
        "What the factory and the model print goes to stderr.")
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
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON document on stdout (also on errors)")
    p.add_argument("--traceback", action="store_true",
                   help="also print the traceback when the factory or the model fails")
    return p


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (a C extension's printf), so they land where fd 1 points
    now."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C library to ask: nothing buffered
        pass


class _StdoutToStderr:
    """While the factory and the model run, what they write to stdout goes to stderr:
    ``sys.stdout`` at the Python level and file descriptor 1 for C extensions, so stdout
    carries only the verdict (or the JSON document)."""

    def __enter__(self):
        self._flush()
        self._stdout = sys.stdout
        self._fd = None
        try:
            self._fd = os.dup(1)
            os.dup2(2, 1)
        except OSError:  # fd 1 or 2 closed: nothing to redirect at that level
            if self._fd is not None:
                os.close(self._fd)
            self._fd = None
        sys.stdout = sys.stderr
        return self

    def __exit__(self, *exc):
        self._flush()
        for stream in (self._stdout, sys.__stdout__):  # written to by a reference kept
            with contextlib.suppress(Exception):
                stream.flush()
        sys.stdout = self._stdout
        if self._fd is not None:
            os.dup2(self._fd, 1)
            os.close(self._fd)
        return False

    @staticmethod
    def _flush():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        _flush_c_stdio()


@dataclasses.dataclass
class _Failure(Exception):
    """The command cannot give a verdict: ``cause`` is ``usage``, ``factory``, ``model``,
    ``interrupted`` or ``ssdtrain`` (check itself); ``message`` says what happened and
    what to do."""

    status: int
    cause: str
    message: str
    trace: str = ""


def _described(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    text = str(e)
    return f"raised {type(e).__name__}" + (f": {text}" if text else "")


def _message(e: ConfigError) -> str:
    s = str(e)
    for prefix in ("ssdtrain check: ", "ssdtrain estimate: ", "ssdtrain: "):
        s = s.removeprefix(prefix)
    return s


def _users_code(cause: str, what: str, where: str, todo: str):
    """A :class:`_Failure` (exit 2) for the user's code that failed by itself: anything
    raised but ``KeyboardInterrupt``, ``sys.exit`` with any code (0 included)."""
    e = sys.exc_info()[1]
    return _Failure(EXIT_USAGE, cause, f"{what} {_described(e)}{where}. {todo}",
                    traceback.format_exc())


def _device(a) -> torch.device:
    try:
        device = torch.device(a.device) if a.device else default_device()
    except (RuntimeError, ValueError):
        raise _Failure(EXIT_USAGE, "usage", f"--device {a.device!r} is not a device; expected "
                       f"cpu or cuda[:N].") from None
    if device.type == "cuda" and default_device().type != "cuda":
        raise _Failure(EXIT_USAGE, "usage", f"--device {a.device}: torch {torch.__version__} "
                       f"sees no CUDA device here; use --device cpu.")
    if device.type not in ("cpu", "cuda"):
        raise _Failure(EXIT_USAGE, "usage", f"--device {a.device}: ssdtrain check runs on cpu "
                       f"or cuda[:N], not {device.type}.")
    return device


def _factory(a):
    """``build()`` for the factory or config the command names."""
    from ..estimate.models import _factory_builder, hf_factory, load_factory

    try:
        if a.factory is not None:
            factory = load_factory(a.factory)
        else:
            factory = hf_factory(a.hf_config)
    except ConfigError as e:
        raise _Failure(EXIT_USAGE, "usage", _message(e)) from None
    except KeyboardInterrupt:
        raise
    except BaseException:  # importing the factory's module ran the user's code
        raise _users_code("factory", f"importing the module of --factory {a.factory}", "",
                          "Fix the module (--traceback shows where); ssdtrain had not run "
                          "yet.") from None
    seq = a.seq if a.seq is not None or a.factory is not None else 128
    build, _ = _factory_builder(factory, batch=a.batch, seq=seq,
                                dtype=getattr(torch, a.dtype) if a.dtype else None,
                                gradient_checkpointing=None)
    return build


def _build(a, build, device):
    """The factory's ``(model, inputs)`` on ``device``, or a :class:`_Failure` naming
    the factory."""
    from ..estimate.replay import EstimateError

    what = f"the factory {a.factory}" if a.factory is not None else \
        f"building the model of --hf-config {a.hf_config}"
    try:
        torch.manual_seed(0)
        model, inputs = build()
    except (ConfigError, EstimateError) as e:  # not (model, inputs), or a config refused
        raise _Failure(EXIT_USAGE, "factory",
                       f"{what} {_message(e).removeprefix('the factory ')}") from None
    except KeyboardInterrupt:
        raise
    except BaseException:
        raise _users_code("factory", what, ", where (model, inputs) was expected",
                          "Fix the factory (--traceback shows where); ssdtrain had not run "
                          "yet.") from None
    if not isinstance(model, torch.nn.Module):
        raise _Failure(EXIT_USAGE, "factory",
                       f"{what} returned ({type(model).__name__}, ...): expected (model, "
                       f"inputs) with model a torch.nn.Module.")
    try:
        return model.to(device), _to(inputs, device)
    except KeyboardInterrupt:
        raise
    except BaseException:
        raise _users_code("factory", f"moving the model and inputs of {what} to {device}", "",
                          "Check --device, and that the inputs are tensors, or tuples, lists "
                          "or dicts of them.") from None


def _fail(f: _Failure, p, out, want_json: bool, show_trace: bool) -> int:
    if f.cause == "usage":
        p.print_usage(sys.stderr)
    if show_trace and f.trace:
        sys.stderr.write(f.trace)
    print(f"{p.prog}: error: {f.message}", file=sys.stderr)
    sys.stderr.flush()
    if want_json:
        doc = {"verdict": "interrupted" if f.status == EXIT_INTERRUPTED else "error",
               "exact": False, "exit_status": f.status, "cause": f.cause, "error": f.message}
        print(json.dumps(doc, indent=2), file=out)
        out.flush()
    return f.status
