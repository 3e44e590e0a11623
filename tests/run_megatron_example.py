"""Run ``examples/megatron_gpt.py`` on a CPU-only machine.

    python tests/run_megatron_example.py --ssdtrain --compare

megatron-core assumes CUDA in its RNG tracker and memory buffer; this enters the test
suite's :func:`megatron_shim.megatron_cpu` (gloo, world size 1, the CPU stand-ins), then
runs the example unchanged as ``__main__`` with the remaining arguments. The example
sees megatron-core already initialized and only seeds it, as it would under
Megatron-LM's own initialization.
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, os.pardir, "examples", "megatron_gpt.py")

if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import megatron_shim

    sys.argv = [EXAMPLE] + sys.argv[1:]
    with megatron_shim.megatron_cpu():
        runpy.run_path(EXAMPLE, run_name="__main__")
