"""The store: the runtime under the store lock, behind the pack and unpack hooks.

- ``store``: the hooks, the lock and its inbox, the passes' boundaries, repair, flush,
  close and fork (NOTE [ The store's paths ]);
- ``table``: the record table, the one way a record's state changes;
- ``writeback``, ``prefetch``, ``hosttier``: the write path, the read path, the host tier;
- ``iothread``: the store's I/O thread; ``events``: failure events and warnings;
- ``probe``: what ``policy="auto"`` measures through a store.

It imports the layers below it (leaves, ``ssdtrain.io``, ``_decision``, ``_device``,
``_config``), never the policies, the estimate or the top (tests/test_layers.py).
"""
