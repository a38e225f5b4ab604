"""The audit freezes the heap that exists before its steps (``audit._frozen_heap``), so a full
collection the traced steps trigger walks only what they made, and unfreezes it after; a
process that froze objects itself keeps its freeze untouched."""
from __future__ import annotations

import gc

import pytest

from torchledger.audit import engine as audit


@pytest.fixture
def unfrozen():
    """This process with nothing frozen (conftest freezes what collection made), restored after."""
    gc.unfreeze()
    yield
    gc.freeze()


def test_the_steps_run_with_the_heap_frozen_and_it_is_unfrozen_after(unfrozen):
    keep = [object() for _ in range(100)]
    seen = []
    with audit._frozen_heap():
        seen.append(gc.get_freeze_count())
    assert seen[0] >= len(keep)             # what existed before the steps was frozen
    assert gc.get_freeze_count() == 0       # and nothing stays frozen


def test_unfrozen_even_when_the_step_raises(unfrozen):
    with pytest.raises(RuntimeError):
        with audit._frozen_heap():
            raise RuntimeError("step failed")
    assert gc.get_freeze_count() == 0


def test_someone_elses_freeze_is_left_alone(unfrozen):
    gc.freeze()
    before = gc.get_freeze_count()
    with audit._frozen_heap():
        pass
    assert gc.get_freeze_count() == before > 0
    gc.unfreeze()


def test_a_process_with_the_gc_off_is_left_alone(unfrozen):
    gc.disable()
    try:
        with audit._frozen_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_an_audit_runs_its_steps_frozen(unfrozen, monkeypatch):
    counts = []
    original = audit._one_step

    def step(*args):
        counts.append(gc.get_freeze_count())
        return original(*args)
    monkeypatch.setattr(audit, "_one_step", step)
    run = audit.run_audit("examples/gpt2_tiny.py", steps=1)
    assert counts and counts[0] > 0 and gc.get_freeze_count() == 0
    assert run.record.totals["flops"]["total"] > 0
