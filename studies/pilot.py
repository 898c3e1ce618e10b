"""An experiment's pilot, read from its runs' records: each arm's learning-rate pick, the must-learn gate
(and the gap), the power calculation from the variance seeds, whether the reported runs may start
(`gate_problems`), and the pilot's page. Its runs are trained by `studies.compare.pilot`."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from otbrl.app.metrics import moving_average, read_metrics
from studies.compare_page import pilot_seeds_text, power_settings, protocol_text
from studies.experiment import (
    Experiment,
    pilot_plan,
    pilot_seeds,
    piloted,
    variance_plan,
)
from studies.inference import power_plan
from studies.outcomes import analyse_rows, budget_pairs, phenomenon_missing
from studies.pages import kilo, markdown_table, read_record
from studies.plots import plot_pilot
from studies.runs import (
    Run,
    has_record,
    kind_labels,
    machine_kind,
    record_path,
    registration,
    wall_seconds,
)


def pilot_rule(exp: Experiment) -> str:
    """The pilot's pick rule in words: the older one (train reward, one seed) or issue 33's (held-out
    reward at the end of the arm's budget, averaged over at least three pilot seeds)."""
    seeds = pilot_seeds(exp)
    if (exp.pilot or {}).get("pick") == "heldout":
        return (
            f"Seeds {', '.join(map(str, seeds))} (not reported seeds). Rule: each arm takes the learning "
            "rate with the highest held-out reward at the end of its budget, averaged over these seeds (the "
            "gate reads the mean gain at the pick); the picks are written into the experiment's YAML before "
            "its reported runs. These numbers are not evidence for any claim."
        )
    return (
        f"Seed {seeds[0]} (not a reported seed). Rule: each arm takes the learning rate with the "
        "highest mean train reward over the last quarter of its steps; the picks are written into the "
        "experiment's YAML before its reported runs. These numbers are not evidence for any claim."
    )


def pilot_score(rows: Path | list[dict[str, Any]]) -> float:
    """The pilot's rule: mean train reward over the last quarter of the run's steps (rows of a
    metrics.jsonl, or a run directory holding one)."""
    if isinstance(rows, Path):
        rows = read_metrics(rows / "metrics.jsonl", "reward")
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, len(rewards) // 4)
    return sum(rewards[-k:]) / k


def run_data(run: Run, records: Path | None) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """(metrics rows, summary) of a finished run: its committed record, else its directory."""
    if has_record(run, records):
        rec = read_record(record_path(records, run.arm, run.seed))
        return rec["metrics"], rec["summary"]
    if (run.dir / "summary.json").is_file():
        return read_metrics(run.dir / "metrics.jsonl"), json.loads((run.dir / "summary.json").read_text())
    return None


def _pick_score(data: tuple[list[dict[str, Any]], dict[str, Any]], by_heldout: bool) -> float:
    """One pilot run's score for the pick: its held-out reward at the end of the run (the arm's final
    budget; `pilot.pick: heldout`, issue 33), else the older rule, its late train reward."""
    rows, summary = data
    if by_heldout:
        after = summary.get("held-out reward after")
        return math.nan if after is None else float(after)
    return pilot_score(rows)


def _seeds_run(data: list[Any]) -> str:
    """A pilot cell whose seeds have not all run: how many have (no mean of the first ones)."""
    done = sum(d is not None for d in data)
    return f"{done} of {len(data)} seeds run" if done else "not run"


def _gain(summary: dict[str, Any]) -> float | None:
    before, after = summary.get("held-out reward before"), summary.get("held-out reward after")
    return None if before is None or after is None else after - before


def gate_need(gate: dict[str, Any], arm: str) -> float:
    """The held-out gain the pilot's gate asks of `arm`: its own threshold, else the common one."""
    return float((gate.get("arms") or {}).get(arm, gate["heldout_gain"]))


def picks_and_gate(
    exp: Experiment, runs: list[Run], records: Path | None
) -> tuple[dict[str, float], list[list[Any]], list[list[Any]], bool]:
    """From the pilot's first-stage runs: each arm's pick (`pilot_score`), the score table, the gate table
    (held-out reward at step 0 and at the end of the picked run, its gain, the arm's threshold) and
    whether every arm passed (True when the pilot has no gate)."""
    gate = (exp.pilot or {}).get("gate")
    by_heldout = (exp.pilot or {}).get("pick") == "heldout"
    lrs = sorted({r.overrides["learning_rate"] for r in runs})
    picks, score_rows, gate_rows, ok = {}, [], [], True
    for arm in piloted(exp):
        mine = [r for r in runs if r.arm.startswith(arm + "@")]
        data: dict[float, list[Any]] = {}
        for r in mine:  # every seed of every rate; a rate is scored only once all its seeds are in
            data.setdefault(r.overrides["learning_rate"], []).append(run_data(r, records))
        scores = {
            lr: statistics.fmean(_pick_score(d, by_heldout) for d in ds)
            for lr, ds in data.items()
            if ds and all(d is not None for d in ds)
        }
        cells = [
            f"{scores[lr]:.3f}" if lr in scores else _seeds_run(data[lr]) if lr in data else "—" for lr in lrs
        ]
        if len(scores) < len(data) or not scores:  # a pick needs every rate of the arm's grid
            score_rows.append([arm, *cells, "pending"])
            if gate is not None:
                need = gate_need(gate, arm)
                gate_rows.append([arm, "pending", "—", "—", "—", f"≥ {need:g}", "pending"])
            ok = False
            continue
        picks[arm] = max(scores, key=scores.__getitem__)
        score_rows.append([arm, *cells, f"{picks[arm]:g}"])
        if gate is not None:
            need = gate_need(gate, arm)
            summaries = [d[1] for d in data[picks[arm]]]
            gains = [g for g in map(_gain, summaries) if g is not None]
            gain = statistics.fmean(gains) if len(gains) == len(summaries) else None  # over the pilot seeds
            passed = gain is not None and gain >= need
            ok &= passed
            gate_rows.append(
                [
                    arm,
                    f"{picks[arm]:g}",
                    _fmt(
                        statistics.fmean(s.get("held-out reward before") for s in summaries)
                        if gain is not None
                        else None
                    ),
                    _fmt(
                        statistics.fmean(s.get("held-out reward after") for s in summaries)
                        if gain is not None
                        else None
                    ),
                    _fmt(gain, sign=True),
                    f"≥ {need:g}",
                    "**passed**" if passed else "**failed**",
                ]
            )
    if gate is not None and gate.get("gap"):
        row, passed = gap_row(gate["gap"], picks, runs, records)
        gate_rows.append(row)
        ok &= passed
    if gate is not None and gate.get("phenomenon"):
        for row, passed in phenomenon_rows(exp, picks, runs, records):
            gate_rows.append(row)
            ok &= passed
    return picks, score_rows, gate_rows, ok


PHENOMENON = "phenomenon: "  # how a gate row of `phenomenon_rows` begins


def phenomenon_rows(
    exp: Experiment, picks: dict[str, float], runs: list[Run], records: Path | None
) -> list[tuple[list[Any], bool]]:
    """The gate's phenomenon (`gate: {phenomenon: true}`): for each comparison, the protocol's floors
    (`phenomenon`, e.g. length_cv_run >= 0.3) read over the first-stage runs of its two arms at their
    picks by the rule that reads the reported runs (`outcomes.phenomenon_missing`). smollm2c's pilot met
    its learning gate while its OTB and GRPO runs averaged a whole-run length CV of 0.286 against the
    0.3 its claims need; this row stops such a task before its reported runs, not after them."""
    out, seen = [], set()
    for c in exp.comparisons:
        arms = (c["candidate"], c["baseline"])
        if arms in seen:
            continue
        seen.add(arms)
        name = f"{PHENOMENON}{' + '.join(arms)}"
        floors = ", ".join(f"{k} ≥ {float(v):g}" for k, v in exp.phenomenon.items())
        data = {
            a: [
                run_data(r, records)
                for r in runs
                if r.arm.startswith(a + "@") and r.overrides["learning_rate"] == picks[a]
            ]
            for a in arms
            if a in picks
        }
        if len(data) < len(arms) or any(not d or None in d for d in data.values()):
            out.append(([name, "pending", "—", "—", "—", floors, "pending"], False))
            continue
        res = {
            "arms": {
                a: {key: [analyse_rows(*d, exp)[key] for d in ds] for key in exp.phenomenon}
                for a, ds in data.items()
            }
        }
        missing, shown = phenomenon_missing(res, exp, arms)
        row = [name, " / ".join(f"{picks[a]:g}" for a in arms), "—", "—", shown, floors]
        out.append(([*row, "**failed**" if missing else "**passed**"], not missing))
    return out


def gap_row(
    gap: dict[str, Any], picks: dict[str, float], runs: list[Run], records: Path | None
) -> tuple[list[Any], bool]:
    """The gate's gap (issue 33, item 3): claim (b) can single out OTB only where the larger group, given
    its budget, beats the smaller one. Passed when the larger arm's held-out reward at the end of its
    budget, at its pick and averaged over the pilot seeds, exceeds the smaller arm's by at least `margin`."""
    ends = {}
    for role in ("larger", "smaller"):
        arm = gap[role]
        mine = [r for r in runs if r.arm == f"{arm}@{picks.get(arm)}"] if arm in picks else []
        data = [run_data(r, records) for r in mine]
        after = [d[1].get("held-out reward after") for d in data if d is not None]
        ends[role] = (
            statistics.fmean(after) if mine and len(after) == len(mine) and None not in after else None
        )
    name = f"gap: {gap['larger']} − {gap['smaller']}"
    if None in ends.values():
        return [name, "pending", "—", "—", "—", f"≥ {float(gap['margin']):g}", "pending"], False
    diff = ends["larger"] - ends["smaller"]
    passed = diff >= float(gap["margin"])
    return [
        name,
        f"{picks[gap['larger']]:g} / {picks[gap['smaller']]:g}",
        _fmt(ends["smaller"]),
        _fmt(ends["larger"]),
        _fmt(diff, sign=True),
        f"≥ {float(gap['margin']):g}",
        "**passed**" if passed else "**failed**",
    ], passed


def pilot_grids(
    exp: Experiment, runs: list[Run], records: Path | None
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Per arm and rate, for reading the pilot (not for its rule): the held-out gain from step 0 to the
    end of the run, and the within-group length CV averaged over every step of the run, each averaged
    over the pilot's seeds as the rule averages its score; a cell with some seeds still to run says how
    many have run, not a mean of the first ones."""
    lrs = sorted({r.overrides["learning_rate"] for r in runs})
    gains, cvs = [], []
    for arm in exp.arms:
        g, c = [arm], [arm]
        for lr in lrs:
            mine = [r for r in runs if r.arm.startswith(arm + "@") and r.overrides["learning_rate"] == lr]
            data = [run_data(r, records) for r in mine]
            if not data or None in data:
                g.append(_seeds_run(data) if data else "—")
                c.append(g[-1])
                continue
            per_run = [_gain(d[1]) for d in data]
            g.append(_fmt(None if None in per_run else statistics.fmean(per_run), sign=True))
            run_cvs = [
                statistics.fmean(values)
                for values in (
                    [row["otb/horizon/length_cv"] for row in d[0] if "otb/horizon/length_cv" in row]
                    for d in data
                )
                if values
            ]
            c.append(_fmt(statistics.fmean(run_cvs)) if len(run_cvs) == len(data) else "—")
        gains.append(g)
        cvs.append(c)
    return gains, cvs


def pilot_curves(
    exp: Experiment, runs: list[Run], records: Path | None, picks: dict[str, float]
) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    """What `plots.plot_pilot` draws: per arm and rate, held-out reward at step 0 and at each budget, and
    the trailing mean of train reward (over a quarter of the run's steps, as the pick rule reads it),
    against generated tokens; and per picked arm the held-out level its gate asks for."""
    gate = (exp.pilot or {}).get("gate")
    curves: dict[str, Any] = {}
    gates: dict[str, tuple[float, float]] = {}
    for r in runs:
        d = run_data(r, records)
        if d is None:
            continue
        rows, summary = d
        arm, lr = r.arm.rpartition("@")[0], float(r.overrides["learning_rate"])
        before = summary.get("held-out reward before")
        held = [(0.0, before)] if before is not None else []
        held += [
            (row["generated_tokens"], row["heldout_reward"]) for row in rows if row.get("heldout_budgets")
        ]
        rewarded = [row for row in rows if "reward" in row]
        w = max(1, len(rewarded) // 4)
        smooth = moving_average([row["reward"] for row in rewarded], w, centred=False)
        train = [(row["generated_tokens"], s) for row, s in zip(rewarded, smooth, strict=False)]
        curves.setdefault(arm, {})[lr] = {"heldout": held, "train": train}
        if gate is not None and picks.get(arm) == lr and before is not None:
            gates[arm] = (lr, before + gate_need(gate, arm))
    return {a: curves[a] for a in exp.arms if a in curves}, gates


def superseded_text(folder: Path) -> str:
    """The runs an amendment set aside (`<folder>/<amendment>/<arm>/seed<k>.json.gz`): kept, not read by
    the picks or the gate, listed with their held-out reward so the reason for the amendment stays
    checkable."""
    lines = []
    for path in sorted(folder.glob("*/*/seed*.json.gz")):
        rec = read_record(path)
        s = rec["summary"]
        lines.append(
            f"- {path.parent.parent.name}: `{rec['arm']}` seed {rec['seed']}, held-out "
            f"{_fmt(s.get('held-out reward before'))} → {_fmt(s.get('held-out reward after'))} "
            f"({_fmt(_gain(s), sign=True)}), {s.get('steps')} steps, "
            f"{s.get('generated tokens', 0) / 1000:.0f}k tokens"
        )
    head = (
        f"Runs set aside by an amendment (their design changed; kept under `{folder.as_posix()}/` for "
        "audit, not read by the picks or the gate):"
    )
    return head + "\n\n" + "\n".join(lines)


def _fmt(value: float | None, sign: bool = False) -> str:
    return "—" if value is None else (f"{value:+.3f}" if sign else f"{value:.3f}")


def power_plans(exp: Experiment, runs: list[Run], records: Path | None) -> list[dict[str, Any]]:
    """The power calculation of each comparison from the pilot's variance seeds: paired differences of
    held-out reward at the comparison's primary budget (its last budget without one), the planned SD
    (an upper confidence limit, `inference.sd_upper`) and the seeds that reach the protocol's power."""
    settings = power_settings(exp)
    by_arm: dict[str, dict[int, float]] = {}
    for r in runs:
        d = run_data(r, records)
        if d is None:
            continue
        heldout = {int(b): row["heldout_reward"] for row in d[0] for b in row.get("heldout_budgets", [])}
        by_arm.setdefault(r.arm.rpartition("@")[0], {})[r.seed] = heldout
    out = []
    arms = set(piloted(exp))  # an arm fixed outside the pilot has no pilot data to plan its comparison on
    for c in (c for c in exp.comparisons if {c["candidate"], c["baseline"]} <= arms):
        budget = int(c.get("primary", c.get("budgets", [0])[-1]))
        budgets, base_budgets = budget_pairs(c)
        base_budget = base_budgets[budgets.index(budget)] if budget in budgets else budget
        cand, base = by_arm.get(c["candidate"], {}), by_arm.get(c["baseline"], {})
        diffs = [
            cand[s][budget] - base[s][base_budget]
            for s in sorted(set(cand) & set(base))
            if budget in cand[s] and base_budget in base[s]
        ]
        kind = c.get("kind", "better")
        calc = power_plan(
            diffs,
            kind,
            float(c.get("margin", 0.0)),
            float(settings["effect"]),
            exp.confidence,
            float(settings["power"]),
            float(settings["sd_level"]),
        )
        out.append(
            {
                "name": c["name"],
                "kind": kind,
                "budget": budget,
                "diffs": diffs,
                **calc,
                "target": settings["power"],
            }
        )
    return out


def gate_problems(exp: Experiment, results: Path) -> list[str]:
    """Why the reported runs may not start yet (empty: they may): with a pilot gate, every arm must have
    passed it in the pilot's committed runs and the YAML must hold each arm's pick; with variance seeds,
    the YAML's `power.seeds` must be at least what the pilot's variance calls for."""
    if not exp.pilot or "gate" not in exp.pilot:
        return []
    records = results / "runs" / f"{exp.name}-pilot"
    stage1 = pilot_plan(exp, Path("runs/compare") / exp.name / "pilot")
    picks, _, gate_rows, ok = picks_and_gate(exp, stage1, records)
    problems = [
        f"{row[0]}: {row[4]} at the picks {row[1]} (needs {row[5]})"
        if row[0].startswith(PHENOMENON)
        else f"{row[0]}: held-out gain {row[4]} at its pick {row[1]} (needs {row[5]})"
        for row in gate_rows
        if row[-1] not in ("**passed**", "pending")
    ]
    if not ok and len(picks) < len(piloted(exp)):
        problems.append(
            f"the pilot has not run (or not every arm): `python -m studies compare {exp.name} --pilot`"
        )
    if not ok and not problems:  # a gate row still pending, whatever it is, keeps the reported runs waiting
        problems.append("the pilot's gate has not passed: a row is still pending (see its page)")
    for arm, lr in picks.items():
        own = (exp.arms[arm] or {}).get("learning_rate")
        if own is None or float(own) != float(lr):
            problems.append(f"{arm}: the YAML's learning_rate is {own}, the pilot picked {lr:g}")
    if ok and exp.pilot.get("variance_seeds"):
        stage2 = variance_plan(exp, Path("runs/compare") / exp.name / "pilot", picks)
        picked = [r for r in stage1 if r.overrides["learning_rate"] == picks.get(r.arm.rpartition("@")[0])]
        plans = power_plans(exp, picked + stage2, records)
        need = [p["seeds"] for p in plans]
        floor = int((exp.power or {}).get("min_seeds", 0))
        have = (exp.power or {}).get("seeds")
        if any(n is None for n in need) or not need:
            problems.append("the pilot's variance seeds are not all run, or call for more than 100,000 seeds")
        elif have is None or int(have) < max(*need, floor):
            problems.append(
                f"power: the pilot's variance calls for {max(need)} seeds per compared arm"
                + (f" and the protocol's floor is {floor}" if floor else "")
                + f"; the YAML's power section says {have}"
            )
    return problems


def machines_text(exp: Experiment, runs: list[Run], records: Path | None) -> str:
    """Where the pilot's recorded runs trained, and the seeds whose runs span machines (with
    `first_stage_any_machine`, the first stage's may: each gain is against its own machine's step-0 score,
    but a power pair on such a seed also differs by machine). "" when no record names a machine."""
    envs = {
        (r.seed, r.arm): read_record(record_path(records, r.arm, r.seed)).get("environment")
        for r in runs
        if has_record(r, records)
    }
    names = kind_labels(envs.values())
    where: dict[int, dict[str, str]] = {}
    for (seed, arm), env in envs.items():
        where.setdefault(seed, {})[arm] = names[machine_kind(env)]
    counts: dict[str, int] = {}
    for arms in where.values():
        for w in arms.values():
            counts[w] = counts.get(w, 0) + 1
    if not counts or set(counts) == {"not recorded"}:
        return ""
    text = "Trained on: " + "; ".join(f"{n} runs on {w}" for w, n in counts.items()) + "."
    split = [
        f"seed {seed}: " + ", ".join(f"{arm} on {w}" for arm, w in sorted(arms.items()))
        for seed, arms in sorted(where.items())
        if len(set(arms.values())) > 1
    ]
    if exp.same_machine:
        rule = (
            "the first stage's seeds may span machines (`pilot.first_stage_any_machine`: its pick and gate "
            "read arm by arm, each run's gain against its own machine's step-0 score), the variance seeds "
            "may not (their pairs set the power)"
            if exp.pilot.get("first_stage_any_machine")
            else "every seed's runs on one kind of machine"
        )
        text += f" Machine rule: {rule}."
    if split:
        text += (
            " Seeds whose runs span machines (a power pair on one of them carries a between-machine "
            "difference too): " + "; ".join(split) + "."
        )
    return text


def main_stage_cost(
    exp: Experiment, plans: list[dict[str, Any]], runs: list[Run], records: Path | None
) -> str:
    """What the reported runs the power calculation calls for would cost, so that a plan out of reach is
    seen before its runs start: the seeds (the largest need, at least the protocol's floor) times the
    compared arms, at the median wall time of a recorded pilot run on each kind of machine ("" until
    every comparison has its number of seeds)."""
    need = [p["seeds"] for p in plans]
    if not need or any(n is None for n in need):
        return ""
    seeds = max(*need, int((exp.power or {}).get("min_seeds", 0)))
    arms = {a for c in exp.comparisons for a in (c["candidate"], c["baseline"])}
    count = seeds * len(arms)
    walls: dict[tuple | None, list[float]] = {}
    envs = []
    for r in runs:
        if not has_record(r, records):
            continue
        rec = read_record(record_path(records, r.arm, r.seed))
        env, wall = rec.get("environment"), wall_seconds(rec)
        if math.isfinite(wall):
            walls.setdefault(machine_kind(env), []).append(wall)
            envs.append(env)
    names = kind_labels(envs)
    text = f"The reported runs at these numbers: {seeds} seeds x {len(arms)} compared arms = {count:,} runs"

    def few(x: float) -> str:  # a tenth where it matters: 0.7 min, 3.2 run-hours; 41 or 1,230 above ten
        return f"{x:,.1f}" if x < 10 else f"{x:,.0f}"

    costs = [
        f"about {few(count * median / 3600)} run-hours on {names[kind] if kind else 'unnamed machines'}"
        f" (the median of its {len(w)} recorded pilot runs: {few(median / 60)} min a run)"
        for kind, w in sorted(walls.items(), key=lambda kv: -len(kv[1]))
        for median in [statistics.median(w)]
    ]
    return text + (": " + "; ".join(costs) if costs else "") + "."


def pilot_page(
    exp: Experiment,
    runs: list[Any],
    results: Path,
    command: str,
    log: Any = print,
    records: Path | None = None,
    stage2: list[Run] | None = None,
) -> tuple[Path, dict[str, float]]:
    """The pilot's picks, gate and power calculation from its finished runs (committed records where
    `records` holds them), and its page `<results>/<name>-pilot.md`."""
    picks, rows, gate_rows, ok = picks_and_gate(exp, runs, records)
    lrs = [f"{lr:g}" for lr in sorted({r.overrides["learning_rate"] for r in runs})]
    results.mkdir(parents=True, exist_ok=True)
    page = results / f"{exp.name}-pilot.md"
    grid = markdown_table(["arm", *(f"lr {lr}" for lr in lrs), "pick"], rows, aligned=False)
    parts = [
        f"# Pilot of experiment `{exp.name}`",
        f"Regenerate: `{command}` (runs with a committed record in `docs/results/runs/{exp.name}-pilot/` "
        f"are not redone; `python -m studies compare {exp.name} --pilot --no-run` rebuilds this page from "
        "them alone).",
        pilot_rule(exp),
        grid,
    ]
    first = [r for r in runs if r.seed == pilot_seeds(exp)[0]]  # the curves read one seed
    gains, cvs = pilot_grids(exp, runs, records)
    head = ["arm", *(f"lr {lr}" for lr in lrs)]
    seeds = pilot_seeds(exp)
    over = f"on {pilot_seeds_text(exp)}" if len(seeds) == 1 else f"the mean over {pilot_seeds_text(exp)}"
    parts += [
        "Held-out gain of each arm and rate (held-out reward at the end of its budget minus at step 0, same "
        f"prompts), {over}, for reading the pilot; the gate reads it at each arm's pick:\n\n"
        + markdown_table(head, gains, aligned=False),
        "Within-group length CV of each arm and rate, averaged over every step of a run, "
        f"{over} (the phenomenon must hold over whole runs: "
        f"{', '.join(f'{k} ≥ {v:g}' for k, v in exp.phenomenon.items()) or 'no floor set'}):\n\n"
        + markdown_table(head, cvs, aligned=False),
    ]
    reg = registration(records) if records is not None else None
    if reg is not None:
        text = protocol_text(exp, {"registration": reg, "protocols": {}}).replace(" Runs: .", "")
        where = machines_text(exp, [*runs, *(stage2 or [])], records)
        parts.insert(2, text + (" " + where if where else ""))
    gate = exp.pilot.get("gate")
    if gate is not None:
        parts.append(
            "Gate (fixed in the protocol before the pilot ran): at its pick, each arm's held-out reward must "
            "rise by at least its threshold from step 0 to the end of its budget"
            + (
                "; and the gap: the larger group's held-out reward at the end of its budget must exceed "
                "the smaller group's at the end of its own by the margin (its row: the smaller's end, the "
                "larger's end, their difference)"
                if gate.get("gap")
                else ""
            )
            + (
                "; and the phenomenon: over each comparison's two arms' runs at their picks, the floor the "
                "claims need (its row: the per-arm means and the mean over both arms' runs), read by the "
                "rule that reads the reported runs"
                if gate.get("phenomenon")
                else ""
            )
            + "; reported runs start only when every row passes. "
            + ("**Every arm passed.**" if ok else "**Not passed: no reported run starts.**")
            + "\n\n"
            + markdown_table(
                ["arm", "pick", "held-out @0", "held-out at the end", "gain", "needs", "gate"],
                gate_rows,
                aligned=False,
            )
        )
    if stage2:
        picked = [r for r in runs if r.overrides["learning_rate"] == picks.get(r.arm.rpartition("@")[0])]
        plans = power_plans(exp, picked + stage2, records)
        prow = [
            [
                p["name"],
                p["kind"],
                kilo(p["budget"]),
                p["pilot_seeds"],
                " ".join(f"{d:+.3f}" for d in p["diffs"]) or "—",
                _fmt(p["pilot_sd"]),
                _fmt(p["sd_planned"]),
                f"{p['floor']:+g}",
                f"{p['delta']:+g}",
                p["seeds"] if p["seeds"] is not None else "—" if math.isnan(p["sd_planned"]) else "> 100,000",
            ]
            for p in plans
        ]
        target = plans[0]["target"] if plans else 0.8
        parts.append(
            f"Power ({pilot_seeds_text(exp)} and variance seeds {exp.pilot['variance_seeds']}, each arm at "
            "its pick): paired differences "
            "of held-out reward at each comparison's primary budget; the plan's SD is the upper 80% "
            "confidence limit of their SD; seeds: the fewest for which the verdict rule says held with "
            f"probability ≥ {target:g} when the true difference is δ ({exp.confidence:.0%} t interval above "
            "the floor; "
            "`studies.inference`). The YAML's `power.seeds` must be at least the largest (and at least "
            "`power.min_seeds`, the protocol's floor, where it sets one).\n\n"
            + markdown_table(
                [
                    "comparison",
                    "kind",
                    "primary budget",
                    "seeds",
                    "differences",
                    "SD",
                    "SD planned",
                    "floor",
                    "δ",
                    "seeds needed",
                ],
                prow,
                aligned=False,
            )
        )
        cost = main_stage_cost(exp, plans, [*runs, *stage2], records)
        if cost:
            parts.append(cost)
    if records is not None and (records / "superseded").is_dir():
        parts.append(superseded_text(records / "superseded"))
    curves, gates = pilot_curves(exp, first, records, picks)  # the first pilot seed: one line per rate
    if curves:
        png = results / f"{exp.name}-pilot.png"
        title = (
            f"Pilot of {exp.name} (seed {exp.pilot['seed']}): held-out and train reward per learning "
            "rate; dotted: the level the gate asks of each arm's pick"
        )
        plot_pilot(curves, png, title, gates)
        parts.insert(4, f"![held-out and train reward of every pilot run]({png.name})")
    page.write_text("\n\n".join(parts) + "\n")
    log(grid)
    return page, picks
