"""An uninstalled checkout (``PYTHONPATH=checkout``, as ``make gpu-check`` runs on a
machine with no network) imports the adapters as ``ssdtrain.integrations``."""

from __future__ import annotations

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
