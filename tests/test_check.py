"""``ssdtrain check`` (ssdtrain/check/): exact on every model of the test zoo, and it
catches planted corruption (a wrong byte on the way back, a view at the wrong offset)
by name; it tells a model that is not deterministic by itself from a mismatch; the
command never shows a traceback for a user error. tests/test_check_contract.py holds
the rest of docs/check.md's promises (state restored, noise, exit statuses, output)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import ssdtrain
from ssdtrain._store.prefetch import ReadPath
from ssdtrain.check import EXIT_MISMATCH, EXIT_NONDETERMINISTIC, EXIT_USAGE, check_model
from ssdtrain.io import faulty

from models import ALL_MODELS


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(ALL_MODELS))
def test_zoo_is_exact_and_the_model_is_left_as_found(name, spill_dir):
    torch.manual_seed(0)
    model, inputs = ALL_MODELS[name]()
    before, rng = _state(model), torch.random.get_rng_state()
    result = check_model(model, inputs, spill_dir=str(spill_dir))
    assert result.exact, result.report()
    assert result.exit_status == 0 and "EXACT" in result.report()
    assert result.stats["offloaded_bytes"] > 0 and result.stats["bytes_read"] > 0, result.stats
    assert result.stats["resident_at_backward_bytes"] < result.stats["unique_bytes"]
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def _mlp():
    torch.manual_seed(0)
    return ALL_MODELS["mlp"]()


def _offloader(spill_dir):
    return ssdtrain.Offloader(ssdtrain.OffloadConfig(policy="static",
                                                     spill_dir=str(spill_dir), min_tensor_bytes=0,
                                                     keep_tail_bytes=0, verify=False))


def test_catches_a_wrong_byte_on_the_way_back(spill_dir):
    """Checksums off (verify=False): a flipped byte in what is read back is silent in
    training, and check names the first gradient it changed."""
    model, inputs = _mlp()
    off = _offloader(spill_dir)
    faulty.install(off, faulty.Fault("read", "corrupt", nth=1, times=None))
    result = check_model(model, inputs, offloader=off)
    off.close()
    assert not result.exact and result.exit_status == EXIT_MISMATCH
    assert result.mismatches and result.mismatches[0].max_abs_diff > 0
    assert any(m.kind == "gradient" for m in result.mismatches)
    names = {n for n, _ in model.named_parameters()}
    assert any(m.name in names for m in result.mismatches)
    assert "MISMATCH" in result.report() and result.mismatches[0].name in result.report()


def test_catches_a_view_at_the_wrong_offset(spill_dir, monkeypatch):
    """A store that rebuilds an unpacked view one element off (the class of bug that
    views over a shared storage invite) is caught."""
    model, inputs = _mlp()
    real = ReadPath.use_locked

    def shifted(self, rec, handle):
        view = real(self, rec, handle)
        st = view.untyped_storage()
        extent = view.storage_offset() + 1 + sum((s - 1) * abs(d) for s, d in
                                                 zip(view.shape, view.stride())) + 1
        if not view.numel():
            return view
        if extent * view.element_size() <= st.nbytes():  # room for a view one element on
            return torch.empty(0, dtype=view.dtype).set_(st, view.storage_offset() + 1,
                                                         view.shape, view.stride())
        # The view covers its storage: the same wrong bytes, each element its neighbour's.
        return view.flatten().roll(-1).view(view.shape)
    monkeypatch.setattr(ReadPath, "use_locked", shifted)
    result = check_model(model, inputs, spill_dir=str(spill_dir))
    assert not result.exact and result.exit_status == EXIT_MISMATCH, result.report()
    assert result.mismatches


def test_a_model_that_is_not_deterministic_is_said_so(spill_dir):
    """Two reference steps differ (a value that alternates between calls): bitwise
    equality cannot be asked for; the ssdtrain step is compared with that spread."""
    calls = [0]

    class Flaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            calls[0] += 1
            return (self.lin(x) * (1.0 + (calls[0] % 2) * 1e-3)).tanh().sum()

    torch.manual_seed(0)
    result = check_model(Flaky(), torch.randn(32, 64), spill_dir=str(spill_dir))
    assert not result.deterministic and not result.exact
    assert result.exit_status == EXIT_NONDETERMINISTIC, result.report()
    assert result.report().startswith("NONDETERMINISTIC") and "not deterministic" in result.report()


def test_a_non_scalar_output_needs_a_loss_fn(spill_dir):
    model = torch.nn.Linear(8, 8)
    with pytest.raises(ssdtrain.ConfigError, match="loss_fn"):
        check_model(model, torch.randn(4, 8), spill_dir=str(spill_dir))
    result = check_model(model, torch.randn(4, 8), spill_dir=str(spill_dir),
                         loss_fn=lambda out: out.square().mean())
    assert result.exact, result.report()


def _cli(args, cwd, monkeypatch, capsys):
    """``ssdtrain check ...`` through the ``ssdtrain`` command's entry point, in this
    process (a subprocess per case costs seconds of imports): ``(status, out, err)``."""
    from ssdtrain.__main__ import main
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))
    status = main(["check", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_on_a_factory_and_an_hf_config(tmp_path, spill_dir, monkeypatch, capsys):
    (tmp_path / "zoo_factory.py").write_text(
        "import torch\n"
        "def make(batch=4):\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),\n"
        "                            torch.nn.ReLU(), torch.nn.Linear(64, 1))\n"
        "    return _Loss(m), torch.randn(batch, 32)\n"
        "class _Loss(torch.nn.Module):\n"
        "    def __init__(self, m):\n"
        "        super().__init__(); self.m = m\n"
        "    def forward(self, x):\n"
        "        return self.m(x).square().mean()\n")
    status, out, err = _cli(["--factory", "zoo_factory:make", "--spill-dir", str(spill_dir),
                             "--json"], tmp_path, monkeypatch, capsys)
    assert status == 0, out + err
    data = json.loads(out)
    assert data["exact"] and data["stats"]["offloaded_bytes"] > 0
    pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    status, out, err = _cli(["--hf-config", str(tmp_path / "config.json"), "--seq", "16",
                             "--spill-dir", str(spill_dir)], tmp_path, monkeypatch, capsys)
    assert status == 0, out + err
    assert "EXACT" in out and "LlamaForCausalLM" in out


def test_cli_user_errors_have_no_traceback(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_factory.py").write_text(
        "def make():\n    raise ValueError('my model cannot be built')\n")
    status, _, err = _cli(["--factory", "broken_factory:make"], tmp_path, monkeypatch, capsys)
    assert status == EXIT_USAGE  # the factory failed by itself: named as the cause
    assert "Traceback" not in err and "my model cannot be built" in err and "--traceback" in err
    status, _, err = _cli(["--factory", "broken_factory:make", "--traceback"], tmp_path,
                          monkeypatch, capsys)
    assert status == EXIT_USAGE and "Traceback" in err and "my model cannot be built" in err
    for args in (["--factory", "nope"], ["--factory", "broken_factory:make", "--batch", "0"],
                 ["--hf-config", str(tmp_path / "missing.json")],
                 []):  # argparse: neither --factory nor --hf-config
        status, _, err = _cli(args, tmp_path, monkeypatch, capsys)
        assert status == EXIT_USAGE, (args, err)
        assert "Traceback" not in err and "error:" in err, args
    (tmp_path / "broken_factory.py").write_text("import sys\ndef make():\n    sys.exit(0)\n")
    monkeypatch.delitem(sys.modules, "broken_factory")  # import the new one
    status, out, err = _cli(["--factory", "broken_factory:make"], tmp_path, monkeypatch, capsys)
    assert status == EXIT_USAGE and out == "" and "sys.exit(0)" in err
