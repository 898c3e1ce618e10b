"""Multi-turn rollouts with tools: call detection, masks, truncation at max turns and at the token budget,
tool failures, and the TRL path (tool tokens never carry energy or advantage; OTB aligns by generated
token). A scripted "model" writes a known text so every position is checked exactly."""

from __future__ import annotations

import math
import os
import random
import re
import types

import pytest
import torch

pytest.importorskip("transformers")

from otbrl.rollout.multiturn import find_call, sample_with_tools  # noqa: E402
from otbrl.tasks import char_tokenizer, get_task, tiny_model  # noqa: E402

TOK = char_tokenizer()
LOGIT = 2.0  # the scripted token's logit, all others 0: its log-prob is known exactly
LOGP = LOGIT - math.log(math.exp(LOGIT) + len(TOK) - 1)


def calc(expr: str) -> str:
    return str(math.prod(int(x) for x in expr.split("*")))


class ScriptedLM(torch.nn.Module):
    """Writes the next character of `script(prompt, completion_so_far)` (None: eos); a script may offer
    several characters, which then get equal logits. It rebuilds each row's context itself, so it sees
    the real tool output that the sampler appended."""

    def __init__(self, script, high: float = LOGIT) -> None:  # noqa: ANN001
        super().__init__()
        self.script, self.high = script, high
        self.config = tiny_model("tiny", vocab_size=len(TOK)).config
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.ctx: list[list[int]] = []

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def forward(self, input_ids, attention_mask, past_key_values=None, **_):  # noqa: ANN001, ANN201
        if attention_mask.shape[1] == input_ids.shape[1]:  # prefill of a new turn
            self.ctx = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
            if past_key_values is not None:  # its state is part of the cache: rows that end leave both
                select = past_key_values.batch_select_indices

                def drop(keep, select=select):  # noqa: ANN001, ANN202
                    self.ctx = [self.ctx[i] for i in keep.tolist()]
                    select(keep)

                past_key_values.batch_select_indices = drop
        else:
            for row, t in zip(self.ctx, input_ids[:, 0].tolist(), strict=True):
                row.append(t)
        logits = torch.zeros(len(self.ctx), 1, len(TOK))  # greedy picks the scripted token
        for i, row in enumerate(self.ctx):
            text = TOK.decode(row, skip_special_tokens=True)
            prompt, _, done = text.partition("=")
            nxt = self.script(prompt + "=", done)
            for tok in [TOK.eos_token_id] if nxt is None else TOK.convert_tokens_to_ids(list(nxt)):
                logits[i, 0, tok] = self.high
        return types.SimpleNamespace(logits=logits)


def product_script(prompt: str, done: str) -> str | None:
    """The two-call demonstration of tir_product3, written from the real tool output seen in `done`."""
    a, b, c = prompt.rstrip("=").split("*")
    outputs = re.findall(r":([^;]*);", done)
    target = f"calc({a}*{b})"
    if len(outputs) >= 1:
        target += f":{outputs[0]};calc({outputs[0]}*{c})"
    if len(outputs) >= 2:
        target += f":{outputs[1]};{outputs[1]}"
    return target[len(done)] if len(done) < len(target) else None


def rollout(prompts: list[str], tools: dict, max_turns: int = 3, budget: int = 64, script=product_script):  # noqa: ANN001, ANN201
    ids = TOK(prompts, add_special_tokens=False)["input_ids"]
    return sample_with_tools(ScriptedLM(script), TOK, ids, tools, budget, max_turns, temperature=0.0)


def test_find_call() -> None:
    tools = {"calc": calc, "py": str}
    assert find_call("so calc(12*3)", tools) == ("calc", "12*3")
    assert find_call(":5;py(print((1+2)*3))", tools) == ("py", "print((1+2)*3)")
    assert find_call("(1+2)", tools) is None  # parentheses that are not a call
    assert find_call("xcalc(1)", tools) is None  # a longer name that ends like a tool's
    assert find_call("calc(1", tools) is None
    assert find_call("calc(1))", tools) is None  # unbalanced


def test_two_calls_masks_and_logprobs() -> None:
    prompts = ["37*482*91=", "10*100*10="]
    out = rollout(prompts, {"calc": calc})
    assert out.texts == [
        "calc(37*482):17834;calc(17834*91):1622894;1622894",
        "calc(10*100):1000;calc(1000*10):10000;10000",
    ]
    assert out.calls == [2, 2]
    task = get_task("tir_product3")
    assert [task.reward(t, str(eval(p[:-1]))) for t, p in zip(out.texts, prompts, strict=True)] == [1.0, 1.0]
    for ids, mask, logp in zip(out.completion_ids, out.model_mask, out.logprobs, strict=True):
        text = TOK.decode(ids)  # eos included
        tool_chars = []
        inside = False
        for ch in text.replace("<eos>", "\x00"):
            inside = inside or ch == ":"
            tool_chars.append(inside)
            inside = inside and ch != ";"
        assert mask == [0 if t else 1 for t in tool_chars]  # tool output (":...;") and only it is 0
        assert all(lp == 0.0 for lp, m in zip(logp, mask, strict=True) if m == 0)
        assert all(lp == pytest.approx(LOGP, abs=1e-6) for lp, m in zip(logp, mask, strict=True) if m == 1)
        assert ids[-1] == TOK.eos_token_id


def test_energy_of_model_tokens_only() -> None:
    """Each model token's energy comes from the logits it was sampled from (scripted: one logit LOGIT,
    the rest 0, so ||e_y - pi||^2 = (1 - pi_y)^2 + (V - 1) q^2 exactly); tool output has none."""
    out = rollout(["37*482*91="], {"calc": calc})
    vocab = len(TOK)
    p_y = math.exp(LOGIT) / (math.exp(LOGIT) + vocab - 1)
    q = 1.0 / (math.exp(LOGIT) + vocab - 1)
    expected = (1 - p_y) ** 2 + (vocab - 1) * q**2
    energy, mask = out.energy[0], out.model_mask[0]
    assert len(energy) == len(out.completion_ids[0])
    assert all(e == 0.0 for e, m in zip(energy, mask, strict=True) if m == 0)
    assert all(e == pytest.approx(expected, rel=1e-5) for e, m in zip(energy, mask, strict=True) if m == 1)


def test_max_turns_leaves_later_calls_as_text() -> None:
    out = rollout(["37*482*91="], {"calc": calc}, max_turns=1)
    assert out.calls == [1]
    text = out.texts[0]
    assert text.startswith("calc(37*482):17834;calc(17834*91)")
    assert text.count(":") == 1  # the second call got no output
    assert sum(out.model_mask[0]) == len(out.completion_ids[0]) - len(":17834;")


def test_budget_cuts_tool_output_and_ends_the_row() -> None:
    out = rollout(["37*482*91="], {"calc": calc}, budget=15)
    assert len(out.completion_ids[0]) == 15
    assert TOK.decode(out.completion_ids[0]) == "calc(37*482):17"
    assert out.model_mask[0] == [1] * 12 + [0] * 3


def test_failing_tool_becomes_output_not_an_exception() -> None:
    def broken(expr: str) -> str:
        raise RuntimeError("boom")

    def stop_after_call(prompt: str, done: str) -> str | None:
        target = "calc(1*2)"
        return target[len(done)] if len(done) < len(target) else None

    out = rollout(["1*2*3="], {"calc": broken}, script=stop_after_call)
    # The character tokenizer has no capitals: they come back as <unk>, which decoding drops.
    shown = TOK.decode(TOK.encode(":error: RuntimeError: boom;"), skip_special_tokens=True)
    assert out.texts == ["calc(1*2)" + shown]
    assert out.calls == [1]


def test_rows_with_different_tool_output_lengths() -> None:
    prompts = [f"{a}*{b}*{c}=" for a, b, c in ((10, 100, 10), (99, 999, 99), (12, 345, 67))]
    out = rollout(prompts, {"calc": calc})
    lengths = [len(ids) - sum(m) for ids, m in zip(out.completion_ids, out.model_mask, strict=True)]
    assert len(set(lengths)) == 3  # tool output lengths differ, so positions of the k-th model token differ
    for p, t in zip(prompts, out.texts, strict=True):
        assert t.rpartition(";")[2] == str(eval(p[:-1]))


def test_warm_start_demonstrations_train_only_model_text() -> None:
    from otbrl.tasks.warmstart import supervised_batch

    task = get_task("tir_product3")
    rng = random.Random(3)
    rows = []
    while len(rows) < 2:  # one demonstration with calls, one direct
        p, a = task.make(rng)
        seg = task.demonstrate(p, a, rng)
        if (len(seg) > 1) == (len(rows) == 0):
            rows.append({"prompt": p, "answer": a, "segments": seg})
    ids, attn, target = supervised_batch(TOK, rows)
    for i, row in enumerate(rows):
        n = int(attn[i].sum())
        pairs = zip(ids[i, 1:n], target[i, : n - 1], strict=True)
        trained = "".join(TOK.decode([int(t)]) for t, f in pairs if f)
        expected = "".join(text for text, train in row["segments"] if train) + "<eos>"
        assert trained == expected


# ----------------------------------------------------------------------------------------------------------
# inside TRL: tool tokens carry no energy and no advantage; OTB aligns by the k-th generated token
# ----------------------------------------------------------------------------------------------------------


def mixed_script(prompt: str, done: str) -> str | None:
    """Coin flips: answer at once (wrongly), or use the calculator in one call (`calc(a*b*c)`) or two.
    Rows of a group then differ in where tool output sits, so OTB's alignments by position and by k-th
    generated token differ."""
    if not done:
        return "c1"
    if done[0] == "1":
        target = "123"
        return target[len(done)] if len(done) < len(target) else None
    a, b, c = prompt.rstrip("=").split("*")
    head = f"calc({a}*{b}"
    if done == head:
        return ")*"
    if not done.startswith(head + "*"):
        return product_script(prompt, done)
    outputs = re.findall(r":([^;]*);", done)
    target = f"{head}*{c})" + (f":{outputs[0]};{outputs[0]}" if outputs else "")
    return target[len(done)] if len(done) < len(target) else None


def test_trl_tool_tokens_get_no_energy_and_no_advantage(tmp_path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("otbrl.integrations.trl")
    from datasets import Dataset

    import otbrl
    from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer
    from otbrl.tasks import dataset

    class Probe(OTBGRPOTrainer):
        seen: list = []

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            out = super()._generate_and_score_completions(inputs)
            Probe.inputs = inputs
            rewards = self._scoring.rewards_per_func.sum(dim=1)
            self.seen.append((out, rewards, self.last_energy, self.last_advantages))
            return out

    def scripted_rollout(prompts: list, trainer) -> dict:  # noqa: ANN001
        ids = TOK(prompts, add_special_tokens=False)["input_ids"]
        out = sample_with_tools(ScriptedLM(mixed_script, high=30.0), TOK, ids, {"calc": calc}, 64, 3, 1.0)
        return {
            "prompt_ids": out.prompt_ids,
            "completion_ids": out.completion_ids,
            "logprobs": out.logprobs,
            "env_mask": out.model_mask,
            "tool_calls": out.calls,
        }

    task = get_task("tir_product3")

    def reward(prompts, completions, answer, **_):  # noqa: ANN001, ANN202
        return [task.reward(c, a) + 0.01 * len(c) for c, a in zip(completions, answer, strict=True)]

    rows = dataset(task, 2, seed=0)
    torch.set_num_threads(1)
    args = OTBGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        max_steps=1,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=64,
        temperature=1.0,
        advantage_estimator="otb",
        seed=0,
    )
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    trainer = Probe(
        model=tiny_model("tiny", vocab_size=len(TOK), seed=0),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=TOK,
        rollout_func=scripted_rollout,
    )
    trainer.train()
    out, rewards, energy, adv = Probe.seen[0]
    tool_mask, completion_mask = out["tool_mask"], out["completion_mask"]
    policy = (tool_mask * completion_mask).bool()
    assert (tool_mask == 0).any() and policy.any()
    assert (energy[~policy] == 0).all() and (energy[policy] > 0).all()
    assert (adv[~policy] == 0).all()
    expected = otbrl.compute_advantages(
        "otb", rewards=rewards, mask=policy, group_ids=torch.arange(16) // 8, energy=energy, align="generated"
    ).advantages
    torch.testing.assert_close(adv, expected)
    by_position = otbrl.compute_advantages(
        "otb", rewards=rewards, mask=policy, group_ids=torch.arange(16) // 8, energy=energy, align="position"
    ).advantages
    assert not torch.allclose(adv, by_position)  # tool output shifts positions: the alignment matters
    calls = [h["otb/tool_calls"] for h in trainer.state.log_history if "otb/tool_calls" in h]
    texts = TOK.batch_decode(out["completion_ids"], skip_special_tokens=True)
    per_row = [t.count(";") for t in texts]
    assert [x["tool_calls"] for x in Probe.inputs] == per_row  # reward functions see the calls too
    assert calls == [pytest.approx(sum(per_row) / 16)]
    assert {t.count(";") for t in texts} == {0, 1, 2}  # every path was taken


def test_tool_timeout_inside_a_rollout() -> None:
    """Model-written code that never ends: the sandbox kills it at its time limit, the rollout gets the
    report as tool output (mask 0) and goes on to the end of the turn."""
    from otbrl.tools import run_python

    results = []

    def py(code: str) -> str:
        results.append(run_python(code, timeout_s=1.0, memory_mb=128, max_output_bytes=200))
        return results[-1].to_text()

    def loop_then_answer(prompt: str, done: str) -> str | None:
        call = "py(while 1: pass)"
        if len(done) < len(call):
            return call[len(done)]
        return "7" if done.endswith(";") else None

    out = rollout(["1*2*3="], {"py": py}, script=loop_then_answer)
    assert [r.limit_hit for r in results] == ["timeout"]
    assert out.calls == [1]
    mask, text = out.model_mask[0], out.texts[0]
    assert text.startswith("py(while 1: pass):") and text.endswith(";7")
    assert mask[: len("py(while 1: pass)")] == [1] * 17 and mask[17] == 0 and mask[-2:] == [1, 1]  # "7", eos


# ----------------------------------------------------------------------------------------------------
# Per-row toolboxes and episodes: an environment whose state lives in its tools


class Counter:
    """A stateful tool: each call returns the next number from `start`, and remembers its calls."""

    def __init__(self, start: int) -> None:
        self.n, self.seen = start, []

    def __call__(self, arguments: str) -> str:
        self.n += 1
        self.seen.append(arguments)
        return str(self.n)


def twice_script(prompt: str, done: str) -> str | None:
    """Calls `d()` twice, then writes the second output: each row's text shows its own tool's state."""
    outputs = re.findall(r":([^;]*);", done)
    target = "d()"
    if outputs:
        target += f":{outputs[0]};d()"
    if len(outputs) >= 2:
        target += f":{outputs[1]};{outputs[1]}"
    return target[len(done)] if len(done) < len(target) else None


def test_each_row_calls_its_own_toolbox():
    boxes = [{"d": Counter(10 * i)} for i in range(3)]
    out = rollout(["1*1*1="] * 3, boxes, script=twice_script)
    assert out.texts == [f"d():{10 * i + 1};d():{10 * i + 2};{10 * i + 2}" for i in range(3)]
    assert [b["d"].n for b in boxes] == [10 * i + 2 for i in range(3)] and out.calls == [2, 2, 2]
    with pytest.raises(ValueError, match="one toolbox per row"):
        rollout(["1*1*1="] * 3, boxes[:2], script=twice_script)


def test_evaluation_gives_each_completion_its_own_seeded_episode():
    from otbrl.rollout import evaluate
    from otbrl.rollout.multiturn import episode_seed

    built: list[tuple[int, str]] = []

    def episode(seed: int, prompt: str) -> dict:
        built.append((seed, prompt))
        return {"d": Counter(seed % 1000)}

    def run(seed: int) -> list[str]:
        texts: list[str] = []

        def score(prompts, completions, answers):  # noqa: ANN001, ANN202
            texts.extend(completions)
            return [1.0] * len(completions)

        rows = [{"prompt": "1*1*1=", "answer": "x"}, {"prompt": "2*2*2=", "answer": "y"}]
        model = ScriptedLM(twice_script)
        evaluate(
            model, TOK, rows, score, 64, 0.0, seed, max_turns=2, samples=2, batch_size=3, episode=episode
        )
        return texts

    texts = run(5)
    seeds = [episode_seed("heldout", 5, i) for i in range(4)]
    assert built == list(zip(seeds, ["1*1*1=", "1*1*1=", "2*2*2=", "2*2*2="], strict=True))
    assert texts == [f"d():{s % 1000 + 1};d():{s % 1000 + 2};{s % 1000 + 2}" for s in seeds]
    assert len(set(texts)) == 4  # the two samples of a prompt met different episodes
    assert run(5) == texts and run(6) != texts  # reproducible from the evaluation's seed
    row = [{"prompt": "1*1*1=", "answer": "x"}]
    with pytest.raises(ValueError, match="at least one call"):
        evaluate(ScriptedLM(twice_script), TOK, row, None, 8, episode=episode)
    with pytest.raises(ValueError, match="non-empty mapping"):
        evaluate(ScriptedLM(twice_script), TOK, row, None, 8, max_turns=1, episode=lambda s, p: {})


def test_episode_seeds_are_stable_and_distinct():
    from otbrl.rollout.multiturn import episode_seed

    assert episode_seed("train", 0, 3, 0, 1, 7) == episode_seed("train", 0, 3, 0, 1, 7)
    seeds = {episode_seed("train", 0, step, 0, 0, row) for step in range(20) for row in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    # a fixed value: the same on every machine and Python (a keyed blake2b, not `hash`)
    assert episode_seed("heldout", 0, 0) == episode_seed("heldout", 0, 0) != episode_seed("heldout", 0, 1)


def test_calls_that_close_inside_a_subword_token_pause_the_row():
    """Subword vocabularies spell `()` or `():` as one token: the row still pauses at the call's end."""
    from otbrl.rollout.multiturn import DEPTH, _CallCloser, paren_table

    vocab = {"(": 0, ")": 1, "()": 2, "():": 3, "x": 4, ")(": 5, "((": 6, "draw": 7}
    after, closes = paren_table(vocab, 9)  # id 8: past the vocabulary, holds no parenthesis
    assert after.shape == closes.shape == (9, DEPTH + 1)
    assert (after[2, 0], bool(closes[2, 0])) == (0, True)  # `()` opens and closes
    assert (after[3, 0], bool(closes[3, 0])) == (0, True)  # `():` too, with a character after it
    assert (after[2, 1], bool(closes[2, 1])) == (1, False)  # inside another call it closes nothing
    assert (after[1, 0], bool(closes[1, 0])) == (0, False)  # a `)` with nothing open
    assert (after[5, 1], bool(closes[5, 1])) == (1, True)  # `)(`: closes, then opens again
    assert (after[6, 0], after[6, DEPTH]) == (2, DEPTH)  # deeper than DEPTH counts as DEPTH
    assert torch.equal(after[4], torch.arange(DEPTH + 1)) and not closes[4].any()
    closer = _CallCloser((after, closes), torch.tensor([True, True, False]))
    steps = [[7, 7, 7], [0, 2, 3], [1, 4, 4], [4, 8, 4]]  # draw ( ) / draw () / draw (): (not allowed)
    paused = [closer(torch.tensor(s)).tolist() for s in steps]
    assert paused == [[False] * 3, [False, True, False], [True, False, False], [False] * 3]


def test_a_call_closed_inside_a_token_still_runs_its_tool():
    """A tokenizer with a `():` token: the tool answers the call (its output after the colon), so the
    model never writes the output itself."""
    from tokenizers import AddedToken

    tok = char_tokenizer()
    tok.add_tokens([AddedToken("():", normalized=False)])
    plan = {"": "d", "d": "():"}  # completion so far -> next token; after the tool's output: eos

    class Model(ScriptedLM):
        def forward(self, input_ids, attention_mask, past_key_values=None, **_):  # noqa: ANN001, ANN201
            if attention_mask.shape[1] == input_ids.shape[1]:
                self.ctx = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
            else:
                for row, t in zip(self.ctx, input_ids[:, 0].tolist(), strict=True):
                    row.append(t)
            logits = torch.zeros(len(self.ctx), 1, len(tok))
            for i, row in enumerate(self.ctx):
                done = tok.decode(row, skip_special_tokens=True).partition("=")[2]
                logits[i, 0, tok.convert_tokens_to_ids(plan.get(done, tok.eos_token))] = LOGIT
            return types.SimpleNamespace(logits=logits)

    model = Model(None)
    model.config.vocab_size = len(tok)
    ids = tok(["1="], add_special_tokens=False)["input_ids"]
    out = sample_with_tools(model, tok, ids, {"d": Counter(4)}, 16, 1, temperature=0.0)
    assert out.calls == [1] and out.texts == ["d():" + ":5;"]
    assert out.model_mask == [[1, 1, 0, 0, 0, 1]]  # d, ():, then the tool's :5; and the model's eos


def test_a_compact_multi_turn_rollout_writes_the_same_completions():
    """Rows pause for their calls at different steps (tool outputs of different lengths): dropping the
    paused and ended rows from the KV cache within each turn changes no token, mask or log-prob."""
    prompts = [f"{a}*{b}*{c}=" for a, b, c in ((10, 100, 10), (99, 999, 99), (12, 345, 67), (1, 2, 3))]
    ids = TOK(prompts, add_special_tokens=False)["input_ids"]
    plain, compact = (
        sample_with_tools(ScriptedLM(product_script), TOK, ids, {"calc": calc}, 64, 3, 0.0, compact=c)
        for c in (False, True)
    )
    assert compact.completion_ids == plain.completion_ids and compact.model_mask == plain.model_mask
    assert compact.logprobs == plain.logprobs and compact.calls == plain.calls == [2] * 4
