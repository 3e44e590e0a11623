"""Build script for ssdtrain.

Project metadata lives in pyproject.toml; this file only says *what* is
installed, because two things cannot be expressed there declaratively:

* ``ssdtrain.integrations`` is installed from the top-level ``integrations/``
  directory (adapters depend on the core, never the reverse, so they are kept
  out of the ``ssdtrain/`` tree);
* the native engine ``ssdtrain._C`` (a pybind11 module built from ``csrc/``).
"""

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["ssdtrain", "ssdtrain.*"])
# `integrations/` and its subpackages are installed under `ssdtrain.integrations`.
PACKAGES += [
    "ssdtrain.integrations" + name[len("integrations"):]
    for name in find_packages(include=["integrations", "integrations.*"])
]

# ---------------------------------------------------------------------------
# NATIVE EXTENSION (csrc/) GOES HERE.
# The torch-free engine `ssdtrain._C` will be added as a pybind11 extension,
# e.g.:
#
#   from pybind11.setup_helpers import Pybind11Extension, build_ext
#   EXT_MODULES = [Pybind11Extension("ssdtrain._C", sorted(glob("csrc/**/*.cpp")), ...)]
#   setup(..., ext_modules=EXT_MODULES, cmdclass={"build_ext": build_ext})
#
# It must not include torch headers or import torch at build time
# (pybind11 is already in [build-system].requires in pyproject.toml).
# When it lands, add csrc/ sources to the Makefile's $(STAMP) prerequisites.
# ---------------------------------------------------------------------------
EXT_MODULES: list = []

setup(
    packages=PACKAGES,
    package_dir={"ssdtrain.integrations": "integrations"},
    ext_modules=EXT_MODULES,
)
