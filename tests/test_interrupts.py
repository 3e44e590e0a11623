"""KeyboardInterrupt anywhere in the store must leave it usable (harness: tests/inject.py).

A training loop that catches KeyboardInterrupt at the step level (to save a
checkpoint, or to skip a step) goes on with the same Offloader. A Ctrl-C can arrive
between any two bytecodes of the training thread: inside the store's lock, after a
request was submitted but before its completion callback was attached, inside
``SlotAllocator.free`` run by ``Handle.__del__`` (where Python swallows it). Bugs
seen: ``close()`` spinning forever in ``flush()`` on a future whose callback was never
attached; KeyError in every later ``alloc`` after a swallowed interrupt; live records
growing without bound under random SIGINTs.

For each line of the store modules the scenario of ``inject.Scenario`` executes on
the training thread (a tiny residual MLP, every record written, prefetch hits and
misses, dedup, ``retain_graph``), the scenario is replayed with a fresh Offloader and
KeyboardInterrupt raised at that line (first run of it, and/or its last), caught at
the step level; then:

1. two more steps give gradients ``torch.equal`` to a run without ssdtrain;
2. with every graph dropped: no live record, no resident byte, no spill slot in use
   (a request an interrupt cut loose from its record holds its slot only until it ends);
3. ``check_invariants()`` passes (where the store has it);
4. ``close()`` returns within ``io_timeout_s`` + 5 s (``io_timeout_s=5``).

The default sweep covers every line once per engine (posix: first run of each line;
native: last run), in parts that take turns by ISO week (NOTE [ Sweeps take turns by
week ] in tests/helpers.py): one engine's half of its targets a week, all four parts
in four weeks, every part at once with ``SSDTRAIN_TEST_ALL_SHARDS=1``.
``SSDTRAIN_TEST_INTERRUPT_FULL=1`` runs every part and the first, middle and last run of
every line on both engines (slow). A failure names the file:line, the occurrence and
the check. Only the training thread is traced: engine completions run on engine
threads, which a SIGINT never interrupts.

Sweeps run in child processes (``inject.sweep_in_children``): a store left with its
lock held blocks an engine thread forever, and a process with such a thread never
exits. Every case is bounded, and one that may have left a thread stuck ends its
child (the next resumes after it), so one broken line fails alone and the others
still run.
"""

from __future__ import annotations

import os

import pytest

import inject
from helpers import part_id, weekly_shard

FULL = os.environ.get("SSDTRAIN_TEST_INTERRUPT_FULL") == "1"
ENGINES = ("posix", "native")
# Default selection per engine: together they interrupt the first and the last run of
# every line the scenario executes (lines run once: by both).
SELECT = {"posix": "first", "native": "last"}
SWEEP_BUDGET_S = 240    # a healthy default sweep takes ~20 s; a broken store costs up to
                        # 15 s (step bound) + 10 s (close bound) per failing target
FULL_BUDGET_S = 3600


def _sweep(spill_dir, engine, select, budget_s, shard=None):
    result, base = inject.sweep_in_children(engine, select, spill_dir, budget_s=budget_s,
                                            shard=shard)
    print(result.summary())
    if base is None:
        pytest.fail(f"[{engine}] the sweep reported no baseline: {result.stopped}",
                    pytrace=False)
    assert base["lines"] > 100, f"[{engine}] only {base['lines']} store lines traced"
    if result.failing or result.stopped:
        pytest.fail(result.message(), pytrace=False)
    assert len(result.outcomes) == base["targets"], result.summary()
    fired = sum(o.fired for o in result.outcomes)
    # Not vacuous: most targets are reached again in the replay (the rest depend on
    # when engine threads complete requests).
    assert fired >= 0.5 * len(result.outcomes), result.summary()


def test_weekly_parts_take_turns_and_cover_every_target(monkeypatch):
    """The parts of a split sweep (NOTE [ Sweeps take turns by week ] in tests/helpers.py)
    are disjoint and together every target, each visits every file, one runs per ISO
    week and ``count`` consecutive weeks run them all; SSDTRAIN_TEST_ALL_SHARDS=1 (or
    SSDTRAIN_TEST_INTERRUPT_FULL=1, or a test's own switch) runs every part."""
    import datetime

    tgts = inject.targets({(f, line): 2 for f in ("a.py", "b.py", "c.py") for line in range(7)})
    tgts += [("d.py", 1, 1, 1)]  # a file with one target: in the first part only
    for count in (1, 2, 3, 4):
        parts = [inject.shard_of(tgts, i, count) for i in range(count)]
        assert sorted(t for part in parts for t in part) == sorted(tgts)
        assert sum(map(len, parts)) == len(tgts)
        assert all({f for f, *_ in part} >= {"a.py", "b.py", "c.py"} for part in parts)
        assert parts[0] == [t for t in tgts if t in parts[0]]  # the sweep's order
    for name in ("SSDTRAIN_TEST_ALL_SHARDS", "SSDTRAIN_TEST_INTERRUPT_FULL", "MY_SWITCH"):
        monkeypatch.delenv(name, raising=False)
    for count in (1, 3, 4):
        weeks = [weekly_shard(count, today=datetime.date.fromisocalendar(2027, w, 3))
                 for w in range(10, 10 + count)]
        assert sorted(s.index for s in weeks) == list(range(count))
        assert all(sum(map(s.runs, range(count))) == 1 for s in weeks)
    assert "SSDTRAIN_TEST_ALL_SHARDS=1" in weekly_shard(3).skip_reason("x", 0)
    for name in ("SSDTRAIN_TEST_ALL_SHARDS", "SSDTRAIN_TEST_INTERRUPT_FULL", "MY_SWITCH"):
        monkeypatch.setenv(name, "1")
        assert all(map(weekly_shard(3, "MY_SWITCH").runs, range(3)))
        monkeypatch.delenv(name)


def test_scenario_exercises_the_store(spill_dir):
    """Not vacuous: without injection the scenario writes every record, reads some on a
    prefetch miss and some prefetched, deduplicates, and passes every check."""
    sc = inject.Scenario()
    off = inject.make_offloader(spill_dir, engine="posix")
    outcome = inject.run_case(sc, off, None)
    stats = off.stats()
    assert not outcome.failures, outcome.failures
    assert stats.records_written > 0 and stats.records_read > 0
    assert stats.prefetch_hits > 0 and stats.prefetch_misses > 0
    assert stats.deduplicated_bytes > 0


# The store sweep in four parts that take turns by ISO week (the suite's time; NOTE
# [ Sweeps take turns by week ] in tests/helpers.py): each engine's targets in halves,
# posix's first half, native's first, posix's second, native's second. Every part with
# SSDTRAIN_TEST_ALL_SHARDS=1 or SSDTRAIN_TEST_INTERRUPT_FULL=1.
STORE_HALVES = 2
STORE_SHARD = weekly_shard(len(ENGINES) * STORE_HALVES)


@pytest.mark.parametrize("half", range(STORE_HALVES),
                         ids=lambda h: part_id(h, STORE_HALVES))
@pytest.mark.parametrize("engine", ENGINES)
def test_interrupt_at_each_store_line(spill_dir, engine, half):
    """KeyboardInterrupt at every store line the scenario runs on the training thread
    (posix: the first run of each line; native: the last), half of them per part."""
    part = ENGINES.index(engine) + len(ENGINES) * half
    if not STORE_SHARD.runs(part):
        pytest.skip(STORE_SHARD.skip_reason(f"store sweep, {engine} half {half + 1}", part))
    _sweep(spill_dir, engine, SELECT[engine], SWEEP_BUDGET_S, shard=(half, STORE_HALVES))


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="set SSDTRAIN_TEST_INTERRUPT_FULL=1 (first, middle and last "
                                     "run of every line, both engines)")
@pytest.mark.parametrize("engine", ENGINES)
def test_interrupt_at_each_store_line_full(spill_dir, engine):
    _sweep(spill_dir, engine, "full", FULL_BUDGET_S)


# NOTE [ Sweeping the step above the store ]
#
# The same harness, one level up: KeyboardInterrupt at the lines of the modules a step
# passes through above the store (inject.STEP_MODULES: api, _forward, _attach,
# _policy, _steps, _adaptive, _profile, _planner, _auto, and the adapters' hooks in
# integrations/; named as modules, found where Python imports them from), each way a
# step can enter the offloader (inject.Scenario.MODES). Every case also checks that close() leaves nothing behind:
# no saved-tensor hooks on the thread's stack, the module-state tracker stopped, no
# hook or recompute wrapper on the model, file descriptors and threads back to what
# the process held before the offloader (inject.check_released).
#
# Selection (deterministic), and why every line is reached: a mode's targets are the
# lines its baseline runs on the training thread in the files listed for it, each at
# its first (or last) run. "with" sweeps api.py, _offloader/forward.py and _decision/policy.py (every
# line a `with offloader:` step runs); "attach" sweeps its own _offloader/attach.py at the last
# run of each line (the api/_forward/_policy lines reached from its hooks, whose
# repairs differ, are in the full sweep: the suite's time); "adaptive" sweeps _policies/adaptive.py
# (profile, recompute-all, plan and probe steps all run inside the armed steps;
# _policies/profile.py's lines are in the full sweep, for the suite's time);
# "deepspeed" sweeps the adapter's engine-forward hook; "default" sweeps _policies/auto.py and
# quota.py, the default policy's controller as is over its sizing, baseline, probe and quota steps
# (on a fake clock, so every run decides alike), "default-api" the API's lines that
# differ under it, "default-probe" the probe it runs (_store/probe.py, a store module). The planner (_policies/planner.py and
# costmodel.py, pure arithmetic run hundreds of times per plan) and _profile.measure_bandwidth (one
# line around the probe, whose own lines "default-probe" sweeps: its buffer and slot are
# its requests', NOTE [ Memory owned by requests ]) are in the full sweep only (SSDTRAIN_TEST_INTERRUPT_FULL=1: every mode, every step module, the
# first, middle and last run of every line, both engines).
#
# The suite's time: a mode's targets are split into ``parts`` that take turns by ISO
# week (NOTE [ Sweeps take turns by week ] in tests/helpers.py); every part with
# SSDTRAIN_TEST_ALL_SHARDS=1.
STEP_SWEEPS = {
    "with": dict(engine="posix", select="first",
                 only="ssdtrain.api,ssdtrain._offloader.forward,ssdtrain._decision.policy,ssdtrain._policies.steps",
                 parts=2),
    "attach": dict(engine="native", select="last", only="ssdtrain._offloader.attach", parts=2),
    "adaptive": dict(engine="posix", select="first", only="ssdtrain._policies.adaptive",
                     skip="ssdtrain._policies.profile:measure_bandwidth", parts=3),
    "deepspeed": dict(engine="posix", select="first", only="ssdtrain.integrations.deepspeed",
                      parts=1),
    "default": dict(engine="posix", select="first",
                    only="ssdtrain._policies.auto,ssdtrain._policies.quota", parts=1),
    # the API's lines that differ under the default policy, in the same scenario
    "default-api": dict(scenario="default", engine="posix", select="first",
                        only="ssdtrain.api,ssdtrain._policies.steps",
                        only_function="ssdtrain.api:Offloader._open_forward,"
                                      "ssdtrain._policies.steps:AutoSteps.begin_step,"
                                      "ssdtrain._policies.steps:AutoSteps.forward_raised,"
                                      "ssdtrain._policies.steps:AutoSteps.end_forward,"
                                      "ssdtrain.api:Offloader._hook_on,"
                                      "ssdtrain.api:Offloader._close_step", parts=1),
    # the hooks coming off past the quota and the prefetch window (NOTE [ Hooks off
    # past the window ] in _policies/auto.py): the API's and the forward state's lines, then the
    # store's pack that calls it
    "cut": dict(scenario="cut", engine="posix", select="first",
                only="ssdtrain.api,ssdtrain._offloader.forward",
                only_function="ssdtrain.api:Offloader._hook_on,ssdtrain.api:Offloader._cut,"
                              "ssdtrain.api:Offloader._unhook,"
                              "ssdtrain._offloader.forward:ForwardState.pop_if_top", parts=1),
    "cut-store": dict(scenario="cut", files="store", engine="posix", select="last",
                      only="ssdtrain._store.store", only_function="ssdtrain._store.store:Store.pack", parts=1),
    # the probe it runs (the disk's bandwidth, the memory's headroom), a store module
    "default-probe": dict(scenario="default", files="store", engine="posix", select="first",
                          only="ssdtrain._store.probe", parts=1),
}
STEP_PARTS = [(mode, part) for mode in sorted(STEP_SWEEPS)
              for part in range(STEP_SWEEPS[mode]["parts"])]
STEP_BUDGET_S = 600


def _step_sweep(spill_dir, mode, engine, select, only, skip="", budget_s=STEP_BUDGET_S,
                shard=None, scenario=None, only_function="", files="step"):
    if mode == "deepspeed":
        pytest.importorskip("deepspeed")
    extra = ("--scenario", scenario or mode, "--files", files, "--only", only,
             "--skip-function", skip, "--only-function", only_function)
    result, base = inject.sweep_in_children(engine, select, spill_dir, budget_s=budget_s,
                                            extra=extra, shard=shard)
    print(result.summary())
    if base is None:
        pytest.fail(f"[{mode}/{engine}] the sweep reported no baseline: {result.stopped}",
                    pytrace=False)
    if result.failing or result.stopped:
        pytest.fail(f"[{mode}] " + result.message(), pytrace=False)
    assert base["targets"] > 0 and len(result.outcomes) == base["targets"], result.summary()
    fired = sum(o.fired for o in result.outcomes)
    assert fired >= 0.5 * len(result.outcomes), result.summary()
    return base


@pytest.mark.parametrize("mode,part", STEP_PARTS, ids=[
    mode if STEP_SWEEPS[mode]["parts"] == 1 else f"{mode}-{part_id(p, STEP_SWEEPS[mode]['parts'])}"
    for mode, p in STEP_PARTS])
def test_interrupt_at_each_step_line(spill_dir, mode, part):
    """KeyboardInterrupt at each line a step runs above the store, for each way a step
    enters the offloader (NOTE [ Sweeping the step above the store ]), a mode's lines in
    parts that take turns by week; after it the same Offloader's next steps are exact
    and nothing is left behind."""
    cfg = STEP_SWEEPS[mode]
    shard = weekly_shard(cfg["parts"])
    if not shard.runs(part):
        pytest.skip(shard.skip_reason(f"step sweep, mode {mode}", part))
    base = _step_sweep(spill_dir, mode, cfg["engine"], cfg["select"], cfg["only"],
                       cfg.get("skip", ""),
                       shard=(part, cfg["parts"]) if cfg["parts"] > 1 else None,
                       scenario=cfg.get("scenario"), only_function=cfg.get("only_function", ""),
                       files=cfg.get("files", "step"))
    want = {inject.short(inject.module_file(m)) for m in cfg["only"].split(",") if m}
    assert set(base["files"]) >= want, base["files"]


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="set SSDTRAIN_TEST_INTERRUPT_FULL=1 (every mode, every step "
                                     "module, first, middle and last run, both engines)")
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", sorted(STEP_SWEEPS))
def test_interrupt_at_each_step_line_full(spill_dir, mode, engine):
    cfg = STEP_SWEEPS[mode]
    _step_sweep(spill_dir, mode, engine, "full", cfg["only"] if "files" in cfg else "",
                budget_s=FULL_BUDGET_S, scenario=cfg.get("scenario"),
                only_function=cfg.get("only_function", ""), files=cfg.get("files", "step"))


# The lines a step under policy="auto" runs once its quota is spent: the tensors
# passed through without a record and their bytes in the prefetch window (NOTE [ The
# pack decision ] in ssdtrain/_decision/policy.py). The store sweep's scenario is static, so
# these are swept here, every run of each line that a step reaches first and last.
PASS_THROUGH = ",".join((
    "ssdtrain._store.store:Store.pack", "ssdtrain._store.store:Store._pass_spent",
    "ssdtrain._store.store:Store.unpack", "ssdtrain._store.store:Store._use_passed_locked",
    "ssdtrain._decision.policy:PassedRanges.add", "ssdtrain._store.table:RecordTable.count_passed",
    "ssdtrain._store.table:RecordTable.use_passed", "ssdtrain._store.table:RecordTable.uncount_passed",
    "ssdtrain._store.store:Store._end_pass_locked"))


# Four parts that take turns by ISO week (NOTE [ Sweeps take turns by week ] in
# tests/helpers.py): the first run of each line in halves, the last run in halves.
PASS_THROUGH_HALVES = 2
PASS_THROUGH_SHARD = weekly_shard(2 * PASS_THROUGH_HALVES)


@pytest.mark.parametrize("half", range(PASS_THROUGH_HALVES),
                         ids=lambda h: part_id(h, PASS_THROUGH_HALVES))
@pytest.mark.parametrize("select", ["first", "last"])
def test_interrupt_at_each_pass_through_line(spill_dir, select, half):
    """KeyboardInterrupt at each line of the quota's pass-through (policy="auto", half a
    step's records written, the rest kept without records); after it the same
    Offloader's next steps are exact and nothing is left behind. The first and the last
    run of each line, half the lines a part, the parts in turn by week."""
    part = ("first", "last").index(select) + 2 * half
    if not PASS_THROUGH_SHARD.runs(part):
        pytest.skip(PASS_THROUGH_SHARD.skip_reason(f"pass-through sweep, {select} run, half "
                                                   f"{half + 1}", part))
    extra = ("--scenario", "auto", "--files", "store", "--only-function", PASS_THROUGH)
    result, base = inject.sweep_in_children("posix", select, spill_dir, budget_s=STEP_BUDGET_S,
                                            extra=extra, shard=(half, PASS_THROUGH_HALVES))
    print(result.summary())
    assert base is not None, result.stopped
    if result.failing or result.stopped:
        pytest.fail(result.message(), pytrace=False)
    assert base["all_targets"] > 20, base  # the whole sweep, both halves
    assert base["targets"] > 0 and len(result.outcomes) == base["targets"], result.summary()
    assert sum(o.fired for o in result.outcomes) >= 0.5 * len(result.outcomes), result.summary()


@pytest.mark.parametrize("where", ["entry", "unhook"])
def test_interrupted_exit_does_not_brick_the_offloader(spill_dir, where):
    """A KeyboardInterrupt landing in ``Offloader.__exit__`` (at its entry,
    before it does anything; or while it removes the hooks) used to leave the forward
    marked open, and every later ``with off:`` raised "already open". Now the next
    ``with off:`` completes the cut-short exit, its step is exact, and nothing is left."""
    import dis
    import sys

    import ssdtrain

    fn = ssdtrain.Offloader.__exit__ if where == "entry" else \
        getattr(ssdtrain.Offloader, "_unhook", None) or ssdtrain.Offloader._stop_hooks
    code = fn.__code__
    line = min(ln for _, ln in dis.findlinestarts(code) if ln and ln > code.co_firstlineno)
    sc = inject.Scenario()
    off = inject.make_offloader(spill_dir, engine="posix")
    injector = inject.InterruptAt(code.co_filename, line, 1)
    with pytest.raises(KeyboardInterrupt):
        sys.settrace(injector)
        try:
            sc.step(0, off)
        finally:
            sys.settrace(None)
    assert injector.fired
    for i in (1, 2):  # the same Offloader: no "already open", exact
        assert sc.compare(i, sc.step(i, off)) is None
    fails = []
    inject.settle_and_check(off, fails)
    off.close()
    inject.check_released(sc, None, fails)
    assert not fails, fails


@pytest.mark.parametrize("engine", ENGINES)
def test_random_sigint_while_training(spill_dir, engine):
    """Real SIGINTs (``os.kill`` from a timer thread, every 1-25 ms) during 1.5 s of
    training steps, each KeyboardInterrupt caught at the step level: completed steps
    exact; afterwards two clean steps exact, nothing left live or resident, and
    ``close()`` returns within its bound."""
    records, rc, tail = inject.run_child(
        [inject.__file__, "sigint", "--engine", engine, "--seconds", "1.5",
         "--seed", "7" if engine == "posix" else "11", "--spill", str(spill_dir),
         "--hang-s", "100"], 120)
    got = [r for r in records if r["kind"] == "sigint"]
    assert got, f"[{engine}] the SIGINT process reported nothing (exit {rc}):\n{tail}"
    fails, info = got[0]["failures"], got[0]["info"]
    print(f"[{engine}] {info}")
    if fails:
        pytest.fail(f"[{engine}] {info}\n" + "\n".join(fails), pytrace=False)
    # Not vacuous: steps were interrupted, and some completed.
    assert info["interrupted"] >= 10 and info["completed"] >= 1, info
