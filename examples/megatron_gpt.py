"""Train a small Megatron-core GPT with ssdtrain switched on by a flag.

    python examples/megatron_gpt.py --ssdtrain --ssdtrain-spill-dir /nvme/ssdtrain --compare

The ``--ssdtrain*`` options are ssdtrain's ``add_ssdtrain_args`` (the same ones a
Megatron-LM script gets by passing it as ``extra_args_provider``); one call,
``apply_args(args, config)``, switches offloading on for the ``TransformerConfig``
before the model is built. It prints the time of each step and what ssdtrain did:
bytes of activations intercepted, written to the SSD (their memory freed once
written) and the peak it held in memory. ``--compare`` trains the same model
without ssdtrain first and checks the losses and gradients are bitwise equal.

It sets megatron-core up the way a Megatron-LM job's initialization does (process
group, model-parallel groups, ``model_parallel_cuda_manual_seed``) and trains on the
GPU. megatron-core's RNG tracker needs CUDA; on a CPU-only machine run it through the
test suite's shim, which stands in for those parts and then runs this file unchanged:

    python tests/run_megatron_example.py --ssdtrain --compare

The defaults are tiny, so it takes seconds.
"""

import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

from ssdtrain.integrations import megatron as ssd_megatron

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

MiB = 1 << 20


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                        help="Megatron's activation recompute, composed with ssdtrain")
    parser.add_argument("--compare", action="store_true",
                        help="also train without ssdtrain and check bitwise equality")
    ssd_megatron.add_ssdtrain_args(parser)           # --ssdtrain, --ssdtrain-spill-dir, ...
    args = parser.parse_args()
    if args.ssdtrain_min_tensor_bytes is None:
        args.ssdtrain_min_tensor_bytes = "16KiB"     # tiny model: its activations are small
    if args.ssdtrain_keep_tail_bytes is None:
        args.ssdtrain_keep_tail_bytes = "64KiB"      # ...so keep only a small tail
    return args


def make_config(args):
    recompute = {"none": {},
                 "selective": dict(recompute_granularity="selective"),
                 "full": dict(recompute_granularity="full", recompute_method="uniform",
                              recompute_num_layers=1)}[args.recompute]
    return TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                             num_attention_heads=args.heads, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             params_dtype=torch.float32, **recompute)


@contextlib.contextmanager
def megatron_initialized():
    """One process, tensor and pipeline size 1: what Megatron-LM's ``initialize_megatron``
    sets up, unless the caller already did (the CPU shim does); undone on exit."""
    undo = contextlib.ExitStack()
    with undo:
        if not dist.is_initialized():
            if not torch.cuda.is_available():
                sys.exit("megatron_gpt.py: megatron-core's RNG tracker needs CUDA and this machine "
                         "has none; run `python tests/run_megatron_example.py ...` instead (the "
                         "test suite's CPU shim, then this script unchanged).")
            torch.cuda.set_device(0)
            tmp = undo.enter_context(tempfile.TemporaryDirectory(prefix="megatron-gpt-"))
            dist.init_process_group("nccl", init_method="file://" + os.path.join(tmp, "rdzv"),
                                    rank=0, world_size=1)
            undo.callback(dist.destroy_process_group)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
            undo.callback(parallel_state.destroy_model_parallel)
        yield


def set_seed(seed):
    """Megatron-LM's seeding: the default generator, then the model-parallel RNG tracker."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def train(args, with_ssdtrain):
    config = make_config(args)
    # The flag: with --ssdtrain this enables offloading for models built from `config`.
    handle = ssd_megatron.apply_args(args, config) if with_ssdtrain else None
    set_seed(1234)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=args.vocab, max_sequence_length=args.seq).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    pos = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool, device=device).triu(1)
    history, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, pos, mask, labels=labels).mean()  # layers offload as they run
        loss.backward()                                      # prefetched back here
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        seconds = time.perf_counter() - t0
        history.append((loss.detach(), grads))
        times.append(seconds)
        print(f"{'ssdtrain' if handle else 'baseline'} step {step}: loss {loss.item():.4f}, "
              f"{seconds * 1e3:.0f} ms")
    steady = sorted(times[1:] or times)  # the first step pays one-time warm-up costs
    print(f"{'ssdtrain' if handle else 'baseline'}: median step time "
          f"{steady[len(steady) // 2] * 1e3:.0f} ms (after the first step; a shared CPU is noisy)")
    if handle is not None:
        handle.offloader.wait()          # writes count when they complete
        stats = handle.stats()
        print(f"ssdtrain: {stats.summary()}")
        print(f"ssdtrain: of {stats.unique_bytes / MiB:.2f} MiB of distinct activations "
              f"intercepted, {stats.offloaded_bytes / MiB:.2f} MiB went to the SSD and left "
              f"memory; ssdtrain held at most {stats.peak_resident_bytes / MiB:.2f} MiB at once")
        for index, layer in handle.layer_stats().items():
            print(f"  layer {index}: {layer.unique_bytes / MiB:.2f} MiB of new records over "
                  f"{layer.passes} forward passes")
        ssd_megatron.disable(config)     # closes the Offloader, restores megatron-core
    return history


def main():
    args = parse_args()
    spill_tmp = None
    if args.ssdtrain and args.ssdtrain_spill_dir is None:
        spill_tmp = tempfile.mkdtemp(prefix="ssdtrain-megatron-")
        args.ssdtrain_spill_dir = [spill_tmp]
    with megatron_initialized():
        reference = train(args, with_ssdtrain=False) if args.compare else None
        history = train(args, with_ssdtrain=args.ssdtrain)
    if spill_tmp is not None:
        os.rmdir(spill_tmp)              # spill files are anonymous: nothing is left inside
    if reference is not None:
        same = all(torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
                   for a, b in zip(reference, history))
        print(f"losses and gradients bitwise equal to the run without ssdtrain: "
              f"{'yes' if same else 'NO'}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
