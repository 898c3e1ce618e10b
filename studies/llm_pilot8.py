"""The eighth round of issue 34's task pilot: chat_draws_told after shorter warm starts.

Why: in pilot 7 (studies/llm_pilot7.py) the 32-step warm start of chat_draws_told started at 0.730 ±
0.026 held-out accuracy, above the rule's window of [0.15, 0.50]: told whether each draw stops, the model
no longer fails on the comparison, and the task became easy. A longer warm start only raised accuracy in
every pilot here (pilot 5: 0.305 after 8 steps, 0.473 after 32; pilot 6: 0.32 after 32, 0.70 after 96),
so pilot 7's 64-step candidate was not run (its page says so) and its core went to this pilot.

Design, rule and pick: pilot 6's, unchanged (its docstring), with the task chat_draws_told and warm
starts of 8 or 16 steps. Fixed before this pilot ran.

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot8 --candidate 8
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot8 --candidate 16   # beside it, one core each
    .venv/bin/python -m studies.llm_pilot8 --page     # docs/results/llm-pilot8.md from both results
"""

from __future__ import annotations

from studies.llm_pilot6 import Pilot, main

PILOT8 = Pilot(8, "chat_draws_told", (8, 16), "shorter warm starts of chat_draws_told")

if __name__ == "__main__":
    main(PILOT8)
