"""Build script for ssdtrain.

Project metadata lives in pyproject.toml; this file only says *what* is
installed, because two things cannot be expressed there declaratively:

* ``ssdtrain.integrations`` is installed from the top-level ``integrations/``
  directory (adapters depend on the core, never the reverse, so they are kept
  out of the ``ssdtrain/`` tree);
* the native engine ``ssdtrain._C`` (a pybind11 module built from ``csrc/``).
"""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

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

EXT_MODULES = [
    Pybind11Extension(
        "ssdtrain._C",
        NATIVE_SOURCES,
        include_dirs=["csrc"],
        depends=sorted(glob("csrc/engine/*.h")),
        cxx_std=17,
        extra_compile_args=["-O2", "-fvisibility=hidden"],
        extra_link_args=["-pthread"],
    )
]

setup(
    packages=PACKAGES,
    package_dir={"ssdtrain.integrations": "integrations"},
    ext_modules=EXT_MODULES,
    cmdclass={"build_ext": build_ext},
)
