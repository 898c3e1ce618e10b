"""A Trainer callback that times each optimizer step, shared by the TRL step benchmarks."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class StepClock(TrainerCallback):
    """CPU time and wall time of each optimizer step, from on_step_begin to on_step_end. On a shared
    machine the wall time mostly measures the other jobs; the process's CPU time (one torch thread) is what
    the step itself costs."""

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self._start = (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self._start = (time.process_time(), time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.cpu.append(time.process_time() - self._start[0])
        self.wall.append(time.perf_counter() - self._start[1])
