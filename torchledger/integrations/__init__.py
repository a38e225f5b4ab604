"""Callbacks that put a ``torchledger.Ledger`` into the training frameworks people already run.

* :mod:`torchledger.integrations.hf`: ``LedgerCallback``, a ``transformers.TrainerCallback``
  (needs ``transformers`` and ``accelerate``).
* :mod:`torchledger.integrations.lightning`: ``LedgerCallback``, a Lightning ``Callback``
  (needs ``lightning``, or the older ``pytorch_lightning``).

Each traces one optimizer step in ``sample_every`` of a real run (every micro-batch of a
gradient-accumulation window, and the optimizer step), writes the records and a report into
the run's output directory under ``torchledger/``, and logs the headline figures (FLOPs per
token, peak bytes, MFU when a peak FLOP/s is given) through the framework's own logging.

Importing this package imports nothing: each framework is imported by its own module, and
only when that module is imported.
"""
