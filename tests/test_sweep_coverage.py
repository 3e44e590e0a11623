"""The interrupt sweeps cover every module of the packages a training step runs through.

tests/inject.py names the modules the sweeps interrupt (``STORE_MODULES``,
``STEP_MODULES``); a name that no longer resolves stops a sweep, but a *new* module a
package gains would be left unswept without a word. This checks the other direction:
every module of the store, the decision, the policies and the Offloader's parts is in
one of the two lists.
"""

import pkgutil

import pytest

import ssdtrain
import inject

# Packages every module of which a step (or the store under it) runs through.
SWEPT_PACKAGES = {
    "ssdtrain._store": inject.STORE_MODULES,
    "ssdtrain._decision": inject.STORE_MODULES + inject.STEP_MODULES,
    "ssdtrain._policies": inject.STEP_MODULES,
    "ssdtrain._offloader": inject.STEP_MODULES,
}


def _modules(package: str):
    mod = __import__(package, fromlist=["__path__"])
    return sorted(f"{package}.{info.name}" for info in pkgutil.iter_modules(mod.__path__))


@pytest.mark.parametrize("package", sorted(SWEPT_PACKAGES))
def test_every_module_of_the_package_is_swept(package):
    listed = set(SWEPT_PACKAGES[package])
    modules = _modules(package)
    assert modules, f"{package} has no modules: the scan is broken"
    missing = [m for m in modules if m not in listed]
    assert not missing, (f"modules of {package} no interrupt sweep covers: {missing}; add "
                         f"them to tests/inject.py (STORE_MODULES or STEP_MODULES)")


def test_the_lists_name_modules_that_exist():
    for name in inject.STORE_MODULES + inject.STEP_MODULES:
        assert inject.module_file(name).endswith(".py"), name
    assert ssdtrain.api.__name__ in inject.STEP_MODULES
