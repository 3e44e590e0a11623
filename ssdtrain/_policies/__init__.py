"""What each training step may offload: the policies behind ``OffloadConfig.policy``.

- ``steps``: a policy as a type (``StepPolicy``: static, auto, adaptive), asked at each
  step's boundary for the step's ``StepLimits`` (NOTE [ Step policies ]);
- ``auto``: the quota controller of ``policy="auto"``;
- ``adaptive``, ``profile``, ``planner``: the adaptive policy's layer profile and its
  keep / offload / recompute planner.

A policy reaches the store only through the Offloader (it hands the store a frozen
``StepLimits``), so this package never imports ``ssdtrain._store``
(tests/test_layers.py).
"""
