"""chat_draws (otbrl.tasks.chat_draws): a multi-turn task whose number of tool calls the environment sets.
The reward accepts exactly the right stop and total, the demonstrations are right answers whose tool
output is marked untrained, every episode ends within the task's calls, and one seed gives one deck."""

from __future__ import annotations

import random
import statistics

import pytest

from otbrl.tasks import dataset, get_task
from otbrl.tasks.chat_draws import (
    CALL,
    MOST_DRAWS,
    OUTPUT_END,
    OUTPUT_START,
    RULES,
    Deck,
    draws_key,
    draws_reward,
    episode,
    parse_answer,
    parse_prompt,
    pose_draws,
)

TASK = get_task("chat_draws")
ANSWER = "start 12, 1-8, stop 6"


def test_markers_are_the_multi_turn_rollouts():
    pytest.importorskip("transformers")
    from otbrl.rollout import multiturn

    assert (OUTPUT_START, OUTPUT_END) == (multiturn.OUTPUT_START, multiturn.OUTPUT_END)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("draw():3; 12 + 3 = 15. draw():7; 15 + 7 = 22. The total is 22.", 1.0),
        ("draw():6; The total is 18.", 1.0),  # the working is not required, the total is
        ("draw():3; 12 + 3 = 15. draw():7; 15 + 7 = 22. The total is 23.", 0.0),  # wrong total
        ("draw():3; 12 + 3 = 15. The total is 15.", 0.0),  # stopped before a draw of 6 or more
        ("draw():7; 12 + 7 = 19. draw():2; 19 + 2 = 21. The total is 21.", 0.0),  # drew after the stop
        ("draw():3; draw():7; The total is 22. Or 25", 0.0),  # the last number counts
        ("The total is 12.", 0.0),  # no draw
        ("draw():7; 12 + 7 = 19.", 1.0),  # the last number after the last draw is the total
        ("draw():7;", 0.0),  # no number after the draw
        ("draw()::7; 12 + 7 = 19.", 1.0),  # the call's last token carried a colon: the tool still answered
        ("redraw():7; 12 + 7 = 19.", 0.0),  # not the tool
        ("draw():3; 15. draw():7; The total is 22.7", 0.0),  # a decimal is not the total
    ],
)
def test_reward(completion, reward):
    assert draws_reward(completion, ANSWER) == reward


def test_every_wording_poses_its_problem_and_keys_it_alike():
    for s, (m, k) in [(12, (8, 6)), (90, (12, 9)), (1, (6, 4))]:
        keys = {draws_key(pose_draws(s, m, k, w)) for w in range(3)}
        assert keys == {f"{s},{m},{k}"}
        # inside a chat template (text before and after the user's message) the problem is the same
        assert parse_prompt(f"<|im_start|>user\n{pose_draws(s, m, k, 1)}<|im_end|>\nassistant") == (s, m, k)
    with pytest.raises(ValueError, match="not a draws problem"):
        parse_prompt("What is 3 + 4?")
    with pytest.raises(ValueError, match="not a draws answer"):
        parse_answer("22")


def test_rules_stop_one_draw_in_three_to_one_in_two():
    for top, stop in RULES:
        assert 1 / 3 <= (top - stop + 1) / top <= 1 / 2


def test_a_deck_ends_by_the_last_call_and_repeats_from_its_seed():
    for seed in range(300):
        deck = Deck(12, 9, seed)
        draws = [int(deck.draw()) for _ in range(MOST_DRAWS)]
        assert all(1 <= d <= 12 for d in draws) and draws[-1] >= 9
        again = Deck(12, 9, seed)
        assert [int(again.draw()) for _ in range(MOST_DRAWS)] == draws
    first = [Deck(10, 7, s).draw() for s in range(50)]
    assert len(set(first)) > 5  # seeds give different decks


def test_an_episode_reads_its_rule_from_the_prompt():
    prompt = pose_draws(30, 6, 5, 2)
    box = episode(3, prompt)
    assert set(box) == {"draw"}
    draws = [int(box["draw"]("")) for _ in range(MOST_DRAWS)]
    assert max(draws) <= 6 and draws[-1] >= 5
    deck = Deck(6, 5, 3)
    assert draws == [int(deck.draw()) for _ in range(MOST_DRAWS)]


def test_demonstrations_are_right_answers_with_their_tool_output_untrained():
    rng = random.Random(0)
    calls, cvs = [], []
    for r in dataset("chat_draws", 200, seed=1, split="train"):
        lengths = []
        for _ in range(4):
            parts = TASK.demonstrate(r["prompt"], r["answer"], rng)
            text = "".join(t for t, _ in parts)
            assert draws_reward(text, r["answer"]) == 1.0
            outputs = [t for t, trained in parts if not trained]
            assert all(o.startswith(OUTPUT_START) and o.endswith(OUTPUT_END) for o in outputs)
            # every untrained part follows a call: a rollout would have paused there
            for i, (_, trained) in enumerate(parts):
                if not trained:
                    assert parts[i - 1][0].endswith(CALL) and parts[i - 1][1]
            calls.append(len(outputs))
            lengths.append(len(text))
        cvs.append(statistics.pstdev(lengths) / statistics.mean(lengths))
    assert 1 <= min(calls) and max(calls) <= MOST_DRAWS and len(set(calls)) >= 4
    # the environment, not the demonstration, sets the length: groups of 4 differ (characters)
    assert statistics.mean(cvs) > 0.3
    with pytest.raises(ValueError, match="does not belong"):
        TASK.demonstrate(pose_draws(5, 8, 6, 0), ANSWER, rng)


def test_the_task_is_multi_turn_with_its_episode():
    assert TASK.tools == ("draw",) and TASK.max_turns == MOST_DRAWS and TASK.episode is episode
    assert TASK.vocabulary == "text" and TASK.max_completion_tokens >= 15 * MOST_DRAWS


def test_the_told_variant_says_stop_or_more_and_is_scored_alike():
    from otbrl.tasks.chat_draws import episode_told

    told = get_task("chat_draws_told")
    assert told.episode is episode_told and told.problems() == TASK.problems()
    for seed in range(100):
        deck, plain = Deck(8, 6, seed, told=True), Deck(8, 6, seed)
        for _ in range(MOST_DRAWS):
            out, n = deck.draw(), int(plain.draw())
            assert out == f"{n} {'stop' if n >= 6 else 'more'}"  # the same numbers, with the verdict
    right = "draw():3 more; 12 + 3 = 15. draw():7 stop; 15 + 7 = 22. The total is 22."
    assert draws_reward(right, ANSWER) == 1
    assert draws_reward("draw():3 more; 12 + 3 = 15. The total is 15.", ANSWER) == 0
    rng = random.Random(1)
    for r in dataset("chat_draws_told", 50, seed=2, split="train"):
        parts = told.demonstrate(r["prompt"], r["answer"], rng)
        outputs = [t for t, trained in parts if not trained]
        assert outputs[-1].endswith(" stop;") and all(o.endswith(" more;") for o in outputs[:-1])
        assert draws_reward("".join(t for t, _ in parts), r["answer"]) == 1.0
