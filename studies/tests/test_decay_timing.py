"""The ladder's replay of the length-surge detector (studies/decay_timing.py)."""

from __future__ import annotations


def test_decay_timing_replays_the_detector_against_collapses():
    """studies/decay_timing.py: a trigger counts as in time only at or before the collapse step, and a
    trigger in a run that never collapsed counts against the detector."""
    from studies import decay_timing as mod

    settings = {"warmup": 5, "window": 20, "cooldown": 10, "zscore": 0.0}
    flat = [80.0] * 30
    surge = [80.0] * 10 + [200.0] * 20  # high from step 11: fires after `patience` (3) high steps, at 13
    assert mod.first_trigger(flat, settings) is None
    assert mod.first_trigger(surge, settings) == 13

    def run(lengths, collapse):  # noqa: ANN001, ANN202
        return {"steps": list(range(1, len(lengths) + 1)), "length": lengths, "collapse": collapse}

    runs = {"a": [run(surge, 15), run(surge, 12), run(flat, 20)], "b": [run(surge, None), run(flat, None)]}
    t = mod.timing(runs, settings)
    assert (t["caught"], t["late"], t["never"], t["false"], t["quiet"], t["lead"]) == (1, 1, 1, 1, 1, 2)
