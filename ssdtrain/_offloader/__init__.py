"""Parts of the :class:`~ssdtrain.Offloader` (``ssdtrain.api``) that are not the store.

- ``forward``: entering and leaving a forward pass, the Offloader's phases
  (NOTE [ Forward phases ]);
- ``attach``: running an Offloader around every training forward of a module.

It imports the leaves and ``ssdtrain._decision`` only (tests/test_layers.py).
"""
