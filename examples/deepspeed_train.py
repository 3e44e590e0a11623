"""Train a small GPT with DeepSpeed, with and without an "ssdtrain" config section.

Run it as ``python examples/deepspeed_train.py`` (one process, CPU or one GPU) or
under a launcher (``deepspeed examples/deepspeed_train.py``, ``torchrun
--nproc_per_node 2 examples/deepspeed_train.py``). The only change from plain
DeepSpeed is the config section and ``ssdtrain.integrations.deepspeed.initialize``
in place of ``deepspeed.initialize``. With ``--checkpoint`` every block runs under
``deepspeed.checkpointing.checkpoint`` and ssdtrain moves the checkpointed blocks'
inputs to the SSD. It prints the step times of both runs, how much activation
memory ssdtrain freed, and checks the losses are bitwise equal.
"""

import argparse
import copy
import os
import socket
import tempfile
import time

import torch
import torch.nn.functional as F

import deepspeed
import ssdtrain.integrations.deepspeed as ssd_deepspeed
from ssdtrain.integrations.distributed import summarize
from gpt import GPT, GPTConfig, make_batch

MiB = 1 << 20


def ds_config(args, spill_dir=None):
    """The DeepSpeed config; with ``spill_dir``, plus the ssdtrain section."""
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero_stage},
    }
    if spill_dir is not None:
        config["ssdtrain"] = {                # <- the whole ssdtrain set-up
            "spill_dir": spill_dir,           # each rank uses its own subdirectory of it
            "min_tensor_bytes": "64KiB",      # smaller saved tensors stay in memory
            "keep_tail_bytes": "1MiB",        # the end of forward stays for backward
            "prefetch_bytes": "16MiB",        # read ahead of backward
        }
        if args.tiny:                         # a tiny model: offload (nearly) everything
            config["ssdtrain"].update(min_tensor_bytes="4KiB", keep_tail_bytes=0,
                                      policy="static")  # every step, from the first
    return config


def forward(model, idx, targets, use_checkpoint):
    """GPT.forward, optionally with each block under deepspeed.checkpointing.checkpoint."""
    if not use_checkpoint:
        return model(idx, targets)
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    for block in model.blocks:
        x = deepspeed.checkpointing.checkpoint(block, x)  # its input goes to the SSD
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Wrapped(torch.nn.Module):
    """Gives DeepSpeed a module whose forward(idx, targets) returns the loss."""

    def __init__(self, model, use_checkpoint):
        super().__init__()
        self.model = model
        self.use_checkpoint = use_checkpoint

    def forward(self, idx, targets):
        return forward(self.model, idx, targets, self.use_checkpoint)


def train(args, model, cfg, spill_dir=None):
    """``args.steps`` DeepSpeed steps; returns per-step (seconds, loss) and the engine."""
    module = Wrapped(copy.deepcopy(model), args.checkpoint)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    engine, _, _, _ = ssd_deepspeed.initialize(model=module, optimizer=opt,
                                               config=ds_config(args, spill_dir))
    gen = torch.Generator().manual_seed(1 + engine.global_rank)  # each rank its own data
    history = []
    for _ in range(args.steps):
        idx, targets = make_batch(cfg, args.batch_size, gen)
        idx, targets = idx.to(engine.device), targets.to(engine.device)
        t0 = time.perf_counter()
        loss = engine(idx, targets)      # with the section: activations go to the SSD...
        engine.backward(loss)            # ...and come back, prefetched, for backward
        engine.step()
        history.append((time.perf_counter() - t0, loss.item()))
    return history, engine


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--checkpoint", action="store_true",
                        help="checkpoint every block with deepspeed.checkpointing")
    parser.add_argument("--spill-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--tiny", action="store_true", help="a very small model (for tests)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args()

    if args.tiny:
        cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=64, n_heads=4, n_layers=2)
        args.steps, args.batch_size = min(args.steps, 2), min(args.batch_size, 4)
    else:
        cfg = GPTConfig(vocab_size=4096, seq_len=256, d_model=256, n_heads=8, n_layers=4)

    # A single process started without a launcher: DeepSpeed needs these to set up
    # torch.distributed (a launcher sets them for every rank).
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if deepspeed.get_accelerator().device_name() == "cpu":
        # CPU only: DeepSpeed would JIT-compile a shared-memory all-reduce for its CPU
        # backend on first use (about a minute; it serves inference only). Skip it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

    torch.manual_seed(0)
    model = GPT(cfg)
    spill_dir = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-ds-")

    ref, ref_engine = train(args, model, cfg)
    ref_engine.destroy()
    got, engine = train(args, model, cfg, spill_dir)
    engine.ssdtrain.wait()                 # writes count when they complete
    mine = engine.ssdtrain.stats()         # this rank
    total = summarize(engine.ssdtrain)     # all ranks (a collective)
    spill = engine.ssdtrain.config.spill_dir
    engine.destroy()                       # closes the offloader too

    if engine.global_rank == 0:
        print(f"GPT {cfg.n_layers} layers, d_model {cfg.d_model}, batch {args.batch_size}x"
              f"{cfg.seq_len}, ZeRO stage {args.zero_stage}, "
              f"{'deepspeed.checkpointing per block, ' if args.checkpoint else ''}"
              f"{engine.world_size} rank(s); rank 0 spills to {spill[0]} ({mine.engine})")
        print(f"{'step':>4} {'DeepSpeed step time (s)':>24} {'+ ssdtrain (s)':>15} {'loss':>10}")
        for i, ((t_ref, loss), (t_off, _)) in enumerate(zip(ref, got)):
            print(f"{i:>4} {t_ref:>24.3f} {t_off:>15.3f} {loss:>10.4f}")
        per_step = mine.unique_bytes / args.steps
        print(f"rank 0 activation memory: {per_step / MiB:.1f} MiB saved for backward per step, "
              f"at most {mine.peak_resident_bytes / MiB:.1f} MiB held by ssdtrain at once "
              f"({1 - mine.peak_resident_bytes / max(per_step, 1):.0%} less); written "
              f"{mine.offloaded_bytes / args.steps / MiB:.1f} MiB/step")
        print(f"all ranks: {total.summary()}")
    same = all(a[1] == b[1] for a, b in zip(ref, got))
    if engine.global_rank == 0:
        print("losses bitwise equal to DeepSpeed alone:", same)
    if args.spill_dir is None:
        for d in spill:
            os.rmdir(d)
        os.rmdir(spill_dir)
    if not same:
        raise SystemExit("ssdtrain: losses differ from the run without offloading; please report.")


if __name__ == "__main__":
    main()
