"""An uninstalled checkout (``PYTHONPATH=checkout``, as ``make gpu-check`` runs on a
machine with no network) imports the adapters as ``ssdtrain.integrations``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_integrations_import_from_an_uninstalled_checkout(tmp_path):
    # -S: no site-packages, so no editable-install finder; torch's folder is put on the
    # path by hand, after the checkout.
    import torch
    site = str(Path(torch.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), site]))
    code = ("import ssdtrain, ssdtrain.integrations.distributed as d; "
            "print(d.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve().parent == REPO_ROOT / "integrations"


def test_setup_finds_pybind11_headers_in_torch_without_the_package(tmp_path):
    """With no network and no ``pybind11`` package (``make gpu-check``, ``pip install
    --no-build-isolation``), setup.py builds against torch's copy of pybind11's headers;
    ``setup.py --name`` declares the extension without compiling it."""
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "pybind11.py").write_text("raise ImportError('no pybind11 here')\n")
    env = dict(os.environ, PYTHONPATH=str(hidden))
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ssdtrain"
    probe = ("import json, runpy, sys; sys.argv = ['setup.py', '--name']; "
             "g = runpy.run_path('setup.py'); print(json.dumps([g['Pybind11Extension'] is None, "
             "g['EXT_MODULES'][0].include_dirs, 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    fallback, include_dirs, torch_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert fallback and not torch_imported
    assert any(p.endswith(os.path.join("torch", "include")) for p in include_dirs)
