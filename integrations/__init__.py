"""Adapters that plug ssdtrain into training frameworks (Megatron-core, DeepSpeed).

Installed as ``ssdtrain.integrations`` (from the top-level ``integrations/``
directory). Adapters depend on the ssdtrain core; the core never imports this
package, so ``import ssdtrain`` works without any framework installed.
"""
