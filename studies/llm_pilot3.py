"""The second round of issue 34's task pilot: the first (studies/llm_pilot2.py, docs/results/llm-pilot2.md)
qualified no candidate. SmolLM2-135M-Instruct, untrained, wrote off-topic text at T=1 and T=0.7, got
two-number sums right 13-28% of the time and sums of three or more numbers, unit conversions and stories
almost never (0-9%).

Candidates (otbrl.tasks.chat_problems), fixed after the first round's results and before this one ran:
    chat_addlist_shown  chat_addlist's 1,992 problems after one fixed worked example ("Example: What is
                        2 + 6 + 1? Working: 2 + 6 = 8, then 8 + 1 = 9. The answer is 9.\\n\\nNow: ...")
    chat_story_shown    chat_story's 3,111 problems after one fixed worked example (a start, a gain, a loss)
The example shows the working a step at a time, so the working's length grows with the problem's steps;
its numbers are not part of the problem (the split key reads only the question after it).

Measurement, rule, fallback, stages and pick order: exactly those of studies/llm_pilot2.py (its
docstring), unchanged: 64 distinct problems x 4 samples, float32, the chat template, 1 thread; qualifies
with >= 1,000 problems, >= 250 held out, accuracy in [0.15, 0.50], within-group length CV >= 0.30, at
most 30% at the cap; the highest CV among those is picked; T=1 first, T=0.7 only if none qualifies at T=1.

    .venv/bin/python -m studies.llm_pilot3          # 15-30 min, 1 thread: docs/results/llm-pilot3.md
    .venv/bin/python -m studies.llm_pilot3 --quick  # 4 problems x 4 per candidate, to a temp file
"""

from __future__ import annotations

from studies.llm_pilot2 import main

CANDIDATES = ("chat_addlist_shown", "chat_story_shown")

if __name__ == "__main__":
    main(CANDIDATES, number=3)
