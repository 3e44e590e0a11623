"""The pack decision and the records it decides about: pure code, no threads, no I/O.

- ``policy``: which saved tensors pass through and which become records, the tail
  window, the quota, a step's limits (NOTE [ The pack decision ]);
- ``records``: records, handles and the table of their legal state transitions
  (NOTE [ Record state machine ]);
- ``budget``: the host tier's part of the decision (``HostBudget``).

The store and the estimate's replay both decide through this package. It imports only
the leaf modules (``ssdtrain._errors``, ``_align``, ``_identity``, ...):
tests/test_layers.py checks that.
"""
