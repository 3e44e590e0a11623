"""Build script for ssdtrain.

Project metadata lives in pyproject.toml; this file only says *what* is
installed, because two things cannot be expressed there declaratively:

* ``ssdtrain.integrations`` is installed from the top-level ``integrations/``
  directory (adapters depend on the core, never the reverse, so they are kept
  out of the ``ssdtrain/`` tree);
* the native engine ``ssdtrain._C`` (a pybind11 module built from ``csrc/``).
"""

import importlib.util
import os
from glob import glob

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # no pybind11 package: torch's copy of its headers (see below)
    Pybind11Extension = build_ext = None

PACKAGES = find_packages(include=["ssdtrain", "ssdtrain.*"])
# `integrations/` and its subpackages are installed under `ssdtrain.integrations`.
PACKAGES += [
    "ssdtrain.integrations" + name[len("integrations"):]
    for name in find_packages(include=["integrations", "integrations.*"])
]

# ---------------------------------------------------------------------------
# The native engine `ssdtrain._C` (csrc/): torch-free C++17, one pybind11 binding
# file. pybind11 comes from [build-system].requires; torch is never imported here.
# The CRC32C hardware path is compiled for SSE4.2 by a target attribute on that one
# function (csrc/engine/crc32c.cpp), not -msse4.2, so the module still loads and
# runs on CPUs without SSE4.2. Extra flags (e.g. the Makefile's sanitizer build)
# come through CFLAGS/LDFLAGS, which setuptools appends.
# ---------------------------------------------------------------------------
NATIVE_SOURCES = sorted(glob("csrc/engine/*.cpp")) + ["csrc/binding.cpp"]

NATIVE_ARGS = dict(
    depends=sorted(glob("csrc/engine/*.h")),
    extra_link_args=["-pthread"],
)


def _torch_pybind11_headers():
    """torch's bundled pybind11 headers (``torch/include/pybind11``), found without
    importing torch: for a build with no network and no pybind11 package (``make
    gpu-check``, ``pip install --no-build-isolation``), never as a build requirement."""
    spec = importlib.util.find_spec("torch")
    for root in (spec.submodule_search_locations or []) if spec else []:
        include = os.path.join(root, "include")
        if os.path.isfile(os.path.join(include, "pybind11", "pybind11.h")):
            return include
    raise SystemExit("ssdtrain: building the native engine needs pybind11's headers: "
                     "pip install pybind11 (or install torch, which ships them)")


if Pybind11Extension is not None:
    EXT_MODULES = [Pybind11Extension(
        "ssdtrain._C", NATIVE_SOURCES, include_dirs=["csrc"], cxx_std=17,
        extra_compile_args=["-O2", "-fvisibility=hidden"], **NATIVE_ARGS)]
    CMDCLASS = {"build_ext": build_ext}
else:
    import sysconfig

    from setuptools import Extension
    EXT_MODULES = [Extension(
        "ssdtrain._C", NATIVE_SOURCES, language="c++",
        include_dirs=["csrc", _torch_pybind11_headers(), sysconfig.get_paths()["include"]],
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"], **NATIVE_ARGS)]
    CMDCLASS = {}

setup(
    packages=PACKAGES,
    package_dir={"ssdtrain.integrations": "integrations"},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
