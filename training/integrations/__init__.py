"""Framework adapters: per-rank telemetry for jobs that train inside a framework's loop.

* ``rankscope.integrations.hf``: Hugging Face ``transformers.Trainer``
  (``pip install 'rankscope[hf]'``), docs/frameworks/hf.md;
* ``rankscope.integrations.lightning``: PyTorch Lightning
  (``pip install 'rankscope[lightning]'``), docs/frameworks/lightning.md;
* ``rankscope.integrations.torchtitan``: torchtitan's ``Trainer``, or its own
  ``main`` through ``python -m rankscope.integrations.torchtitan``
  (``pip install 'rankscope[torchtitan]'``), docs/frameworks/torchtitan.md.

Each module imports its framework; this package imports none, so the core
installs and imports without any framework. Each drives the same ``Monitor``
steps as a hand-written loop (``rankscope.integrations.events``), so every
metric, alert, recording rule and dashboard works unchanged.
"""
