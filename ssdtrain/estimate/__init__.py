"""Know before you buy or launch: what ssdtrain would save, offload and keep.

``ssdtrain estimate`` (also ``python -m ssdtrain estimate``) builds the model on the
meta device, runs one forward on fake tensors with ssdtrain's own pack decisions
(``ssdtrain/estimate/replay.py``), and reports per micro-batch and per repeated block the
bytes saved, deduplicated, offloaded and kept; with hardware numbers also the SSD
bandwidth needed to hide the I/O behind compute, the largest micro-batch that fits
device memory with no offload, full recompute and ssdtrain, and the drives' write
volume and endurance; with ``--plan`` the adaptive policy's keep / offload /
recompute plan per block within a memory budget, and its predicted step time and peak
memory beside none, checkpoint-all and offload-all (NOTE [ Plan from the estimate ]);
with ``--host-budget`` the host-RAM tier (NOTE [ Host tier ] in ``_store/hosttier.py``): the
bytes held in RAM, their peak, and those that go on to the SSD (or, with ``--no-ssd``,
stay in device memory), and with ``--plan`` each tier priced at its own bandwidth
(``--host-gbps`` for the device <-> host link).
Nothing is allocated: an 8B-parameter model at sequence 4096 estimates in seconds on a
laptop. Formulas: docs/estimate.md.

The package: ``replay`` (the forward on fake tensors through the pack decision; ``fake``
makes and runs the fake tensors, ``flops`` counts the forward's FLOPs),
``models`` (what can be estimated: ``--factory``, Hugging Face configs), ``hardware``,
``memory`` (:func:`estimate` and its arithmetic), ``report`` (:class:`Estimate`),
``plan`` (the planner on the estimate) and ``cli``. It imports the leaves, ``_config``,
``_decision`` and the policies' profile, cost model and planner, never the store
(tests/test_layers.py).

Example::

    ssdtrain estimate --hf-config examples/configs/llama-8b.json --seq 4096 \\
        --device-memory 139GiB --tflops 400 --ssd-write-gbps 6 --ssd-read-gbps 7 \\
        --ssds 4 --ssd-tbw 7000

    from ssdtrain.estimate import estimate, Hardware
    est = estimate("examples/configs/llama-8b.json", seq=4096,
                   hardware=Hardware(device_memory="139GiB", tflops=400,
                                     ssd_write_gbps=6, ssds=4))
    print(est.table()); est.to_json()
    print(est.plan().table())   # budget: device memory - weights, gradients, optimizer
"""

from .cli import main
from .hardware import DEFAULT_HOST_GBPS, DTYPES, Hardware
from .memory import estimate
from .models import hf_factory, load_factory, non_text_inputs
from .plan import (PLAN_LETTERS, PlanEstimate, compact_plan, make_plan, plan_costs,
                   predict_choices)
from .replay import EstimateError
from .report import Estimate

__all__ = ["estimate", "Estimate", "Hardware", "EstimateError", "hf_factory", "load_factory",
           "main", "DTYPES", "PlanEstimate", "make_plan", "plan_costs", "predict_choices",
           "compact_plan", "non_text_inputs", "DEFAULT_HOST_GBPS", "PLAN_LETTERS"]
