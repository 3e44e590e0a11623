"""Quickstart: train a small GPT a few steps with and without ssdtrain.

Run it with ``make demo`` (or ``python examples/quickstart.py``). It prints, per
step, the time and the bytes of activations ssdtrain held in memory at its peak
against the bytes autograd saved, and checks the losses and gradients are
bitwise equal to a run without offloading.
"""

import argparse
import os
import tempfile
import time

import torch

import ssdtrain
from gpt import GPT, GPTConfig, make_batch

MiB = 1 << 20


def train(steps, cfg, batch_size, offloader=None):
    """Plain SGD steps; returns per-step (seconds, loss) and the final parameters."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    history = []
    for _ in range(steps):
        idx, targets = make_batch(cfg, batch_size, gen)
        t0 = time.perf_counter()
        if offloader is None:
            loss = model(idx, targets)
        else:
            with offloader:             # activations saved here go to the SSD...
                loss = model(idx, targets)
        loss.backward()                 # ...and come back, prefetched, for backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append((time.perf_counter() - t0, loss.item()))
    return history, [p.detach().clone() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--spill-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=4096, seq_len=256, d_model=256, n_heads=8, n_layers=4)
    spill_dir = args.spill_dir or tempfile.mkdtemp(prefix="ssdtrain-demo-")

    ref, ref_params = train(args.steps, cfg, args.batch_size)
    # policy="static": every step offloads (the default, "auto", offloads as much after
    # its first step only where memory needs it or the disk absorbs it in time;
    # docs/guide.md).
    off = ssdtrain.Offloader(spill_dir=spill_dir, policy="static", min_tensor_bytes="64KiB",
                             keep_tail_bytes="8MiB", prefetch_bytes="16MiB")
    got, params = train(args.steps, cfg, args.batch_size, off)
    stats = off.stats()
    off.close()  # waits for I/O, releases the (anonymous) spill files
    if args.spill_dir is None:
        os.rmdir(spill_dir)

    print(f"GPT {cfg.n_layers} layers, d_model {cfg.d_model}, batch {args.batch_size}x"
          f"{cfg.seq_len}; spill_dir {spill_dir} ({stats.engine})")
    print(f"{'step':>4} {'no offload (s)':>15} {'ssdtrain (s)':>13} {'loss':>10}")
    for i, ((t_ref, loss), (t_off, _)) in enumerate(zip(ref, got)):
        print(f"{i:>4} {t_ref:>15.3f} {t_off:>13.3f} {loss:>10.4f}")
    per_step = stats.unique_bytes / args.steps
    print(f"activations saved per step: {per_step / MiB:.1f} MiB; written to disk: "
          f"{stats.offloaded_bytes / args.steps / MiB:.1f} MiB/step; most ssdtrain held in memory "
          f"at once: {stats.peak_resident_bytes / MiB:.1f} MiB "
          f"({1 - stats.peak_resident_bytes / per_step:.0%} less)")
    print(f"prefetch: {stats.prefetch_hits} hits, {stats.prefetch_misses} misses, "
          f"stalled {stats.stall_seconds * 1e3:.1f} ms")
    same = all(torch.equal(a, b) for a, b in zip(ref_params, params)) and \
        all(a[1] == b[1] for a, b in zip(ref, got))
    print("losses and parameters bitwise equal to no offload:", same)
    if not same:
        raise SystemExit("ssdtrain: results differ from the run without offloading; please report.")


if __name__ == "__main__":
    main()
