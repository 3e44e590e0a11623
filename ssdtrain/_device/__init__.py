"""The device path: records whose storage lives in accelerator memory.

- ``transfers``: the ordering rules of device records, written once against a leaf
  (NOTE [ Device records ]), pinned staging and the copies the hooks start;
- ``cuda``: the CUDA leaf, the only module of ssdtrain that touches ``torch.cuda``.

The loopback device, the stand-in leaf that runs this code where no GPU is, is in
``ssdtrain.testing.loopback``. This package imports the leaves, ``ssdtrain.io`` and
``ssdtrain._decision``; never the store (tests/test_layers.py).
"""
