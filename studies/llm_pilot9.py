"""The ninth round of issue 34's task pilot: chat_draws_told between pilot 8's two warm starts.

Why: in pilot 8 (studies/llm_pilot8.py) chat_draws_told started at 0.086 ± 0.019 held-out accuracy after
8 warm-start steps and at 0.527 ± 0.036 after 16 (within-group CV 0.526 and 0.320): one below the rule's
window of [0.15, 0.50], one just above it. Pilot 7 had shown that this task keeps its length variation
under RL (CV 0.43 over 16 OTB steps, 0.48 over the last 8, after a 32-step warm start at 0.730).

Design, rule and pick: pilot 6's, unchanged (its docstring), with the task chat_draws_told and warm
starts of 10 or 12 steps. Fixed before this pilot ran, when pilot 8's 16-step candidate had its probe
but not yet its RL steps.

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot9 --candidate 12
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot9 --candidate 10
    .venv/bin/python -m studies.llm_pilot9 --page     # docs/results/llm-pilot9.md from both results
"""

from __future__ import annotations

from studies.llm_pilot6 import Pilot, main

PILOT9 = Pilot(
    9,
    "chat_draws_told",
    (10, 12),
    "between pilot 8's warm starts",
    notes="The 12-step candidate's first run was killed by the kernel's out-of-memory killer at its second "
    "RL step (three processes at once, one of them the test suite; this one at 13 GB); it ran again from "
    "its saved warm start with the same seeds.",
)

if __name__ == "__main__":
    main(PILOT9)
