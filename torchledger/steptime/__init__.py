"""The time model room: a step's time on a named GPU predicted from its record. ``predict``
prices each traced op and collective with the closed forms of ``formulas.steptime`` and
``formulas.hardware``, schedules the stages and the overlap, and writes ``meta.step_time``;
``calibrate`` fits the few global efficiency parameters to measured records.

It reads records and formulas only (never hooks or torch): the checks in ``analyzers`` and
the commands read its results."""
