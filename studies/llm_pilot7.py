"""The seventh round of issue 34's task pilot: chat_draws_told, where each draw says whether it stops.

Why: in pilot 6 (studies/llm_pilot6.py) the 32-step warm start of chat_draws (held-out accuracy
0.32 ± 0.03, within-group length CV 0.44) did not follow the stop rule: its answers went on after a
stopping draw, or stopped after a low one (3.1 draws an answer where the decks give 2-3). Under RL its
answers first fell to 1.1-1.5 draws (steps 2-9: stop at once, which is right when the first draw happens
to stop the episode) and then rose to 2.2-4.3 (steps 10-16); the within-group CV averaged 0.21 over the
16 steps and 0.24 over the last 8, below the floor of 0.3. (Its 96-step candidate had not finished its
RL steps when this pilot was registered.) The model did not compare a draw with the stop number, so how
many draws an answer took was again its own choice, not the environment's. chat_draws_told
(otbrl.tasks.chat_draws) returns the rule's verdict with each draw (`draw():7 stop;`, `draw():3
more;`): the same problems, reward and decks, and the comparison is no longer the model's to make.
(Corrected after the run: the split is its own, salted by the task's name as every task's is: 323 of the
1,080 problems held out, where chat_draws holds out 317. This docstring first said "the same split".)

Design, rule and pick: pilot 6's, unchanged (its docstring), with the task chat_draws_told and warm
starts of 32 or 64 steps (64 instead of 96: pilot 6's 96-step warm start took about 25 minutes here).
Fixed before this pilot ran.

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot7 --candidate 32
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot7 --candidate 64   # beside it, one core each
    .venv/bin/python -m studies.llm_pilot7 --page     # docs/results/llm-pilot7.md from both results
"""

from __future__ import annotations

from studies.llm_pilot6 import Pilot, main

PILOT7 = Pilot(
    7,
    "chat_draws_told",
    (32, 64),
    "each draw says whether it stops",
    skipped=(
        (
            64,
            "the 32-step candidate started at 0.730 held-out accuracy, above the rule's window [0.15, 0.50], "
            "and a longer warm start only raised accuracy in every pilot here (pilot 5: 0.305 after 8 steps, "
            "0.473 after 32; pilot 6: 0.32 after 32, 0.70 after 96), so it could not qualify; its core went "
            "to pilot 8 (shorter warm starts of the same task, docs/results/llm-pilot8.md).",
        ),
    ),
)

if __name__ == "__main__":
    main(PILOT7)
