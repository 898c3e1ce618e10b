"""The third round of issue 34's task pilot: pilots 2 and 3 (studies/llm_pilot2.py, llm_pilot3.py; their pages
docs/results/llm-pilot2.md, llm-pilot3.md) qualified no candidate. SmolLM2-135M-Instruct, untrained, solved
sums of three or more numbers, unit conversions and multi-step stories almost never (0-9%); only two-number
sums reached 13-28% (pilot 2) and 5-14% (pilot 3, after a worked example). So every candidate here poses
two numbers and one step, and takes its numbers from 1-50 so that the space holds >= 1,000 problems.

Candidates (otbrl.tasks.chat_problems), fixed after pilot 3's results and before this one ran:
    chat_pair        a sum of two numbers 1-50 in chat_addlist's four wordings ("What is 23 + 38?"); 1,275
                     problems (unordered pairs)
    chat_pair_mixed  a sum or a difference of two numbers 1-50, half each, four wordings each ("What is
                     38 - 23?", "Subtract 23 from 38."); 2,550 problems (each pair's sum and difference)
    chat_pair_story  one gain or one loss told as a story, half each, four wordings each ("Tom has 38
                     marbles. He gives 23 away. How many marbles does Tom have now?"); 2,550 problems
A difference never goes below zero (the larger number comes first). The problem key is the operation and
the sorted numbers, so every wording of a problem falls on one side of the split.

Measurement, rule, fallback, stages and pick order: exactly those of studies/llm_pilot2.py (its
docstring), unchanged, through its `main`: 64 distinct problems x 4 samples, float32, the chat template,
at most 128 new tokens, 1 thread; qualifies with >= 1,000 problems, >= 250 held out, accuracy in
[0.15, 0.50], within-group length CV >= 0.30, at most 30% at the cap; the highest CV among those is
picked; T=1 first, T=0.7 only if none qualifies at T=1; then the fallback (accuracy [0.10, 0.60], CV
>= 0.25, at most 40% at the cap, provisional) at T=1, then at T=0.7.

    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot4          # ~40 min: docs/results/llm-pilot4.md
    OMP_NUM_THREADS=1 .venv/bin/python -m studies.llm_pilot4 --quick  # 4 problems x 4, to a temp file
"""

from __future__ import annotations

from studies.llm_pilot2 import main

CANDIDATES = ("chat_pair", "chat_pair_mixed", "chat_pair_story")

if __name__ == "__main__":
    main(CANDIDATES, number=4)
