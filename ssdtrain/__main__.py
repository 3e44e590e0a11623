"""The ``ssdtrain`` command (console script; also ``python -m ssdtrain``).

Subcommands:

* ``estimate``: what ssdtrain would save, offload and keep for a model, from the model
  alone (``ssdtrain/estimate/``, docs/estimate.md).
* ``check``: one training step of a model with and without ssdtrain, compared bitwise
  (``ssdtrain/check/``).
"""

import sys

_USAGE = """usage: ssdtrain <command> [options]

commands:
  estimate   bytes saved, offloaded and kept per micro-batch, SSD bandwidth, largest
             micro-batch and drive endurance, from a model config (nothing allocated)
  check      one training step of your model without and with ssdtrain (every eligible
             tensor through the SSD), loss/gradients/buffers compared bitwise

`ssdtrain <command> --help` describes a command's options.
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "estimate":
        from .estimate import main as estimate_main
        return estimate_main(rest, prog="ssdtrain estimate")
    if command == "check":
        from .check import main as check_main
        return check_main(rest, prog="ssdtrain check")
    sys.stderr.write(_USAGE + f"\nssdtrain: error: unknown command {command!r} (known: estimate, "
                     f"check)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
