"""What each training step may offload: the policies behind ``OffloadConfig.policy``.

- ``steps``: a policy as a type (``StepPolicy``: static, auto, adaptive), asked at each
  step's boundary for the step's ``StepLimits`` (NOTE [ Step policies ]);
- ``auto``: the quota controller of ``policy="auto"``, ``quota`` its pure arithmetic;
  ``stall``: the static policy's watch on I/O waits;
- ``adaptive``, ``profile``, ``layers``, ``planner``, ``costmodel``: the adaptive policy's
  layer profile (and the layers and buffers it sees), its keep / offload / recompute
  planner and the planner's step cost model.

A policy reaches the store only through the Offloader (it hands the store a frozen
``StepLimits``), so this package never imports ``ssdtrain._store``
(tests/test_layers.py).
"""
