"""The Megatron adapter under pipeline parallelism: a real 2-stage ``GPTModel`` pipeline.

megatron-core 0.16.1, ``pipeline_model_parallel_size=2`` on 2 spawned CPU processes
(gloo), trained through megatron-core's own schedule
(``megatron.core.pipeline_parallel.get_forward_backward_func()``): the 1F1B schedule
with several micro-batches (also with ``deallocate_pipeline_outputs``, Megatron-LM's
default), and the interleaved (virtual-pipeline) schedule with two model chunks per
stage. The CUDA assumptions of the schedules and their
point-to-point communication are covered by ``tests/megatron_shim.py`` (its
``CPUTorch``; the canary in tests/test_megatron.py lists the names).

Per schedule, each rank trains its stage twice from the same seed, without and with
``ssdtrain.integrations.megatron.enable(config, ...)``, and saves what it saw; the
test process asserts:

* every micro-batch loss (last stage) and every parameter gradient on every stage
  ``torch.equal`` to the run without ssdtrain, at every step;
* offloaded bytes > 0 on both stages, and every offloaded byte read back;
* prefetch follows the schedule's backward order: after the first (cold) step,
  unpacks find their record read or being read (``Stats.prefetch_hits``), at most
  two still on disk over the warm steps (``Stats.prefetch_misses``: 0 on an idle
  machine, 1 seen where the I/O thread ran late; 6 when the schedule is not
  followed) when the prefetch window holds the stage's in-flight micro-batches. In 1F1B the first
  stage runs the backward of an *older* micro-batch than the one that forward just
  ended (F1 B0 F2 B1 ...); the offloader moves the pass whose backward began to
  the front of the prefetch queue (``Stats.prefetch_hits`` counts the reads it
  started ahead).

One spawn runs every schedule (the processes' start-up, torch and megatron-core
imports, is most of the time).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import pytest
import torch

from helpers import spawn_ranks

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install megatron-core==0.16.1")

WORLD = 2
LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH, VOCAB = 4, 64, 4, 32, 2, 128
MICRO_BATCHES = 4
STEPS = 3
# keep_tail_bytes=0: every record is written and read back, so the prefetch counters
# cover every offloaded record; min_tensor_bytes above the 1 KiB bool mask.
OPTIONS = dict(policy="static", keep_tail_bytes=0, write_behind_bytes=0, min_tensor_bytes=2048,
               engine="posix")
# name -> (virtual_pipeline_model_parallel_size, TransformerConfig overrides).
# deallocate_pipeline_outputs (Megatron-LM's default): a stage's output is emptied once
# sent, and backward runs through Megatron's custom_backward.
SCHEDULES = {"1f1b": (None, {}),
             "1f1b-deallocate": (None, dict(deallocate_pipeline_outputs=True)),
             "interleaved": (2, {})}

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron")]


# ------------------------------------------------------------------ one rank

def make_config(vpp, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
              params_dtype=torch.float32, pipeline_dtype=torch.float32,
              pipeline_model_parallel_size=WORLD, virtual_pipeline_model_parallel_size=vpp)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_chunks(config, vpp, seed=1234):
    """This rank's model chunks (one without a virtual pipeline)."""
    import megatron_shim
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    megatron_shim.manual_seed(seed)
    chunks = []
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
            max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=vp_stage),
            vp_stage=vp_stage))
    return chunks


def micro_batches(step):
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
        causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked out
        out.append((ids, position_ids, causal, labels))
    return out


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: the chunk's output and its loss function."""
    ids, pos, mask, labels = next(data_iterator)
    output = model(ids, pos, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train(chunks, steps=STEPS, on_step=None):
    """SGD steps through megatron-core's pipeline schedule. Per step: the micro-batch
    losses this rank saw (last stage only) and every gradient (cloned), by name."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    params = [(f"chunk{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    forward_backward = get_forward_backward_func()
    history = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        data = micro_batches(step)
        start = time.perf_counter()
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=[iter(data) for _ in chunks],
            model=chunks, num_microbatches=MICRO_BATCHES, seq_length=SEQ,
            micro_batch_size=MICRO_BATCH, forward_only=False)
        elapsed = time.perf_counter() - start
        history.append(([d["loss"] for d in losses],
                        {n: p.grad.clone() for n, p in params if p.grad is not None}, elapsed))
        opt.step()
        if on_step is not None:
            on_step(step)
    return history


def _init_rank(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)


def _pipeline_rank(rank, port, out_dir, spill_base, prefetch_bytes):
    """Both schedules on this rank, each without and with ssdtrain; saves what it saw."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron_shim
        from ssdtrain.integrations import megatron as ssd_megatron
    _init_rank(rank, port)
    result = {}
    for name, (vpp, overrides) in SCHEDULES.items():
        with warnings.catch_warnings(), megatron_shim.megatron_cpu(
                pipeline_model_parallel_size=WORLD, virtual_pipeline_model_parallel_size=vpp):
            warnings.simplefilter("ignore")
            ref = train(build_chunks(make_config(vpp, **overrides), vpp))
            config = make_config(vpp, **overrides)
            handle = ssd_megatron.enable(config, spill_dir=spill_base,
                                         prefetch_bytes=prefetch_bytes, **OPTIONS)
            try:
                chunks = build_chunks(config, vpp)
                per_step = []

                def snapshot(step):
                    handle.offloader.wait()
                    per_step.append(dataclasses.asdict(handle.stats()))

                got = train(chunks, on_step=snapshot)
                layers = {i: dataclasses.asdict(s) for i, s in handle.layer_stats().items()}
                spill = handle.offloader.config.spill_dir
            finally:
                ssd_megatron.disable(config)
            result[name] = dict(ref=ref, ssdtrain=got, stats=per_step, layers=layers,
                                spill_dir=spill, chunks=len(chunks))
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    torch.distributed.destroy_process_group()


# ------------------------------------------------------------------ the test process

def run_ranks(tmp_path, prefetch_bytes, timeout_s=300):
    out_dir, spill_base = tmp_path / "out", tmp_path / "spill"
    out_dir.mkdir()
    spill_base.mkdir()
    spawn_ranks(_pipeline_rank, (str(out_dir), str(spill_base), prefetch_bytes), WORLD,
                timeout_s, what="pipeline ranks")
    return [torch.load(out_dir / f"{r}.pt", weights_only=False) for r in range(WORLD)]


def assert_same_history(ref, got, where):
    assert len(ref) == len(got) == STEPS
    for step, ((ref_losses, ref_grads, _), (losses, grads, _)) in enumerate(zip(ref, got)):
        assert len(losses) == len(ref_losses)
        for i, (a, b) in enumerate(zip(ref_losses, losses)):
            assert torch.equal(a, b), f"{where} step {step}: loss of micro-batch {i}: {b} != {a}"
        assert grads.keys() == ref_grads.keys() and grads, where
        for name, ref_grad in ref_grads.items():
            assert torch.equal(grads[name], ref_grad), (
                f"{where} step {step}: gradient of {name} differs (max abs diff "
                f"{(grads[name] - ref_grad).abs().max().item()!r})")


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory):
    """One spawn of 2 ranks; the prefetch window (1 MiB) holds a stage's in-flight
    micro-batches (about 0.3 MiB each per stage here)."""
    return run_ranks(tmp_path_factory.mktemp("pipeline"), prefetch_bytes=1 << 20)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_equal_to_megatron_without_ssdtrain(pipeline_results, schedule):
    for rank, r in enumerate(pipeline_results):
        res = r[schedule]
        assert res["chunks"] == (SCHEDULES[schedule][0] or 1)
        assert_same_history(res["ref"], res["ssdtrain"], f"{schedule} stage {rank}")
    # The last stage saw one loss per micro-batch, the first none.
    assert all(len(losses) == 0 for losses, _, _ in pipeline_results[0][schedule]["ref"])
    last = pipeline_results[1][schedule]["ref"]
    assert all(len(losses) == MICRO_BATCHES for losses, _, _ in last)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_offloads_on_both_stages(pipeline_results, schedule):
    for rank, r in enumerate(pipeline_results):
        res = r[schedule]
        stats = res["stats"][-1]
        assert stats["offloaded_bytes"] > 0, f"stage {rank} offloaded nothing"
        assert stats["bytes_read"] == stats["offloaded_bytes"], \
            f"stage {rank}: backward did not read every record back"
        # Every layer of this stage ran under interception once per micro-batch and step.
        layers = res["layers"]
        assert len(layers) == LAYERS // WORLD
        for i, s in layers.items():
            assert s["passes"] == STEPS * MICRO_BATCHES and s["unique_bytes"] > 0, (rank, i, s)
    assert pipeline_results[0][schedule]["spill_dir"] != pipeline_results[1][schedule]["spill_dir"]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_prefetch_follows_the_schedule(pipeline_results, schedule):
    for rank, r in enumerate(pipeline_results):
        per_step = r[schedule]["stats"]
        warm_misses = per_step[-1]["prefetch_misses"] - per_step[0]["prefetch_misses"]
        warm_hits = per_step[-1]["prefetch_hits"] - per_step[0]["prefetch_hits"]
        print(f"{schedule} stage {rank}: warm steps: prefetch hits {warm_hits}, misses "
              f"{warm_misses}; cold step: hits {per_step[0]['prefetch_hits']}, misses "
              f"{per_step[0]['prefetch_misses']}")
        assert warm_hits > 0
        # The reads are started by the store's I/O thread, which a loaded machine can
        # leave unscheduled for a moment: a read not yet started when a pass's backward
        # begins is a miss (CI saw 1 in the interleaved schedule; 0 on an idle machine).
        # Without the promotion of the pass whose backward began (ReadPath.promote_locked), the
        # interleaved schedule's first stage misses 6 here: more than 2 is that bug.
        assert warm_misses <= 2, \
            f"{schedule} stage {rank}: {warm_misses} prefetch misses, {warm_hits} hits"
