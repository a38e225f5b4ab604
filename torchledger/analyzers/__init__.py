"""Analyzers: checks over step records. Each reads records (and the closed forms of
:mod:`torchledger.formulas`) and returns findings; none prints, plots or touches torch.

* :mod:`.checks` - ``run_checks(records, options)``: every check below, as ``trace``, ``Ledger``
  and ``audit`` run them; fake-kernel gaps, uncounted ops, untraced parts.
* :mod:`.compare` - the step against its closed forms (6ND + attention, static bytes, 12Ld²);
  ``record_predictions`` fills ``record.predictions``. :mod:`.compare_shape` reads the shape.
* :mod:`.leaks` - memory that grows or outlives steps (TL-LEAK-*).
* :mod:`.copies` - needless copies (TL-COPY-*).
* :mod:`.mfu` - the report's one MFU and its rules (TL-MFU-*).
* :mod:`.fit` - the peak against a GPU's memory (TL-MEM-002); :mod:`.outputs` - returned caches.
* :mod:`.snapshot` (with :mod:`.snapshot_format`, :mod:`.snapshot_history`) - CUDA allocator
  snapshots read, validated and summarised (TL-CUDA-*).

Rule ids, titles and default severities: :mod:`torchledger.rules`.

    >>> from torchledger.analyzers.checks import run_checks
    >>> findings = run_checks([t.record], {"min_mfu": 0.4})
"""
