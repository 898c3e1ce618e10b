"""The page of a registered study of claim (a) (`python -m studies variance-a [--study NAME]`:
docs/results/NAME.md and .png), made from its committed per-batch data alone; no measurement happens here."""

from __future__ import annotations

import math
from typing import Any

from studies.pages import markdown_table
from studies.plots import plot_registered_variance
from studies.variance_a import (
    BUCKETS,
    cell_stats,
    load_records,
    power_plan,
    reading,
    rule_text,
    study_command,
)


def _iv(iv: Any, digits: int = 3) -> str:
    """ratio [lo, hi] of a `gradstats.RatioInterval`."""
    if not math.isfinite(iv.ratio):
        return "no signal"
    if not (math.isfinite(iv.lo) and math.isfinite(iv.hi)):
        return f"{iv.ratio:.{digits}f} [undetermined]"
    return f"{iv.ratio:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


def _registration_lines(data: Any, stage: str) -> list[str]:
    import json

    path = data / stage / "protocol.json"
    if not path.is_file():
        return [f"- {stage}: not registered yet (no run)."]
    reg = json.loads(path.read_text())
    committed = {True: "the YAML committed", False: "the YAML NOT committed", None: "commit unknown"}
    lines = [
        f"- {stage}: protocol `{reg['hash']}` registered {reg['registered']} at its first run "
        f"({committed[reg.get('committed')]}, commit {str(reg.get('commit'))[:10]})."
    ]
    for a in reg["amendments"]:
        lines.append(
            f"  - amendment {a['at']} (`{a['hash']}`; changed: {', '.join(a['changed'])}): {a['reason']}"
        )
    return lines


def write_registered_page(study: Any, results: Any, data: Any) -> Any:
    """results/variance-a.md (and .png once main data exist) from the committed records under `data`."""
    pilot, main = load_records(study, data, "pilot"), load_records(study, data, "main")
    verdict, _ = reading(study, main)
    cand, base = study.candidate, study.baseline
    name = study.name + ("-quick" if study.quick else "")
    measure = (
        f"`{study_command(study.name)}` (its pilot and checkpoints are {study.raw['pilot_from']}'s)"
        if study.raw.get("pilot_from")
        else f"`{study_command(study.name, '--pilot')}`, then `{study_command(study.name)}`"
    )
    lines = [
        "# Claim (a), the mechanism, under a registered protocol: OTB's gradient noise against the "
        "group mean's",
        "",
        f"Verdict: **{verdict}** (rule: {rule_text(study)}).",
        "",
        f"Protocol: `studies/experiments/variance/{study.name}.yaml` (its comments give the design and "
        "every rule, written before any run). Registration:",
        "",
        *_registration_lines(study.home(data), "pilot"),
        *_registration_lines(data, "main"),
        "",
        (
            f"It re-measures [{study.raw['pilot_from']}.md]({study.raw['pilot_from']}.md)'s cells with new "
            "batches at the K its power rule asks for (its YAML says why)."
            if study.raw.get("pilot_from")
            else "It replaces, for claim (a), the legacy study without a registered protocol "
            "([variance.md](variance.md), [variance-walk.md](variance-walk.md))."
        ),
        "",
        f"Regenerate this page from the committed per-batch data alone (docs/results/{study.name}/): "
        f"`{study_command(study.name, '--no-run')}`. Measure (resuming): {measure} (one torch thread).",
        "",
        "What is measured: per cell (task x checkpoint x N), K independent batches of `prompts` fresh "
        "prompts x N samples; on each batch both estimators' policy gradients "
        "g = (1/B) Σ_i Σ_t A_it ∇θ log π(y_it) on the same samples: "
        f"{cand} (OTB, Logit-Gradient Proxy energy, self-inclusive) and {base} (A = R − group mean). "
        "NSR = trace Cov(g) / ‖E g‖² over the K batches (‖E g‖² estimated without bias); the ratio "
        f"NSR({cand}) / NSR({base}) below 1 means OTB's gradient is less noisy relative to its signal. "
        "95% interval: delete-one jackknife SE of log(ratio), Student t at K − 1 df. Buckets: policy "
        "token k of a response (0-based) is early if k < late_from, late otherwise (the gradient "
        "restricted to a bucket masks the advantages; early + late = all).",
        "",
    ]
    if main:
        complete = len(pilot) == len(study.cells())
        scaled = not complete or power_plan(study, pilot)["scale"] < 1  # the rule's K cut to the budget
        lines += _registered_results(study, main, cand, base, BUCKETS, cell_stats, scaled)
        plot_registered_variance(
            {c.name: cell_stats(r)["buckets"] for c, r in main.items()}, results / f"{name}.png", cand, base
        )
        lines += [f"![NSR ratio per cell and bucket with 95% intervals]({name}.png)", ""]
    else:
        lines += ["Main runs: none recorded yet.", ""]
    if pilot:
        lines += _pilot_section(study, pilot, power_plan, cell_stats)
    out = results / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return out


def _registered_results(
    study: Any, main: dict, cand: str, base: str, buckets: tuple[str, ...], cell_stats: Any, scaled: bool
) -> list[str]:
    stats = {c: cell_stats(r) for c, r in main.items()}
    machines = sorted({f"{r['machine']}; CPU flags: {r['cpu_flags']}" for r in main.values()})
    loads = [x for r in main.values() for x in r["load_average"]]
    cpu = sum(b["cpu_seconds"] for r in main.values() for b in r["batches"])
    wall = sum(b["wall_seconds"] for r in main.values() for b in r["batches"])
    head = ["cell", "K", f"NSR({cand})", f"NSR({base})", "ratio [95% interval]", "SE of log ratio"]
    rows = [
        [
            f"{c.task} {c.checkpoint} N={c.n}",
            s["k"],
            _iv(s["buckets"]["all"]["nsr"][cand], 2),
            _iv(s["buckets"]["all"]["nsr"][base], 2),
            _iv(s["buckets"]["all"]["ratio"]),
            f"{s['buckets']['all']['ratio'].log_se:.3f}",
        ]
        for c, s in stats.items()
    ]
    below = sum(
        math.isfinite(s["buckets"]["all"]["ratio"].hi) and s["buckets"]["all"]["ratio"].hi < 1
        for s in stats.values()
    )
    above = sum(
        math.isfinite(s["buckets"]["all"]["ratio"].lo) and s["buckets"]["all"]["ratio"].lo > 1
        for s in stats.values()
    )
    bucket_rows = [
        [
            f"{c.task} {c.checkpoint} N={c.n}",
            f"{main[c]['late_from']}",
            *(f"{s['means'][f'tokens_{b}'] / (main[c]['prompts'] * c.n):.1f}" for b in buckets),
            *(_iv(s["buckets"][b]["ratio"]) for b in buckets),
        ]
        for c, s in stats.items()
    ]
    describe = [
        [
            f"{c.task} {c.checkpoint} N={c.n}",
            f"{s['means']['reward']:.3f}",
            f"{s['means']['length']:.1f}",
            f"{s['means']['length_cv']:.2f}",
            f"{s['means']['energy_cv']:.2f}",
            f"{s['means']['reward_spread']:.2f}",
            _iv(s["buckets"]["all"]["variance_ratio"]),
        ]
        for c, s in stats.items()
    ]
    checkpoints = {}
    for c, r in main.items():
        about = r["checkpoint"]
        checkpoints[(c.task, c.checkpoint)] = [
            c.task,
            c.checkpoint,
            about["source"],
            "-" if about.get("reward") is None else f"{about['reward']:.3f}",
            f"`{about['weights']}`",
        ]
    return [
        f"Machine(s): {' | '.join(machines)}. Main runs: {cpu / 60:.1f} min of CPU ({wall / 60:.1f} min "
        f"wall) over all cells, one torch thread; the machine was shared (1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} at the cells' starts and ends).",
        "",
        "## Primary: every cell, all policy tokens",
        "",
        markdown_table(head, rows),
        "",
        f"The interval lies below 1 in {below} of {len(stats)} cells and above 1 in {above}. The K are the "
        "registered power rule's"
        + (", scaled to the CPU budget" if scaled else ", not scaled (the CPU budget covers them)")
        + " (see the pilot section below for the power they were planned to reach).",
        "",
        "## Secondary: by position bucket (no verdict)",
        "",
        "Tokens per response in each bucket (mean over the batches), and the ratio restricted to the bucket.",
        "",
        markdown_table(
            ["cell", "late from", *(f"tokens {b}" for b in buckets), *(f"ratio {b}" for b in buckets)],
            bucket_rows,
        ),
        "",
        _bucket_reading(stats),
        "",
        "## The samples, per cell (means over the batches)",
        "",
        "Length CV, energy CV: within-group std / mean of the response length and of W_T; reward spread: the "
        f"share of groups whose rewards differ. Variance ratio: trace Cov({cand}) / trace Cov({base}) (not "
        "scale-free: a self-inclusive baseline's shrinkage lowers it; secondary).",
        "",
        markdown_table(
            ["cell", "reward", "length", "length CV", "energy CV", "reward spread", "variance ratio"],
            describe,
        ),
        "",
        "## Checkpoints",
        "",
        "Reward: the warm start's sampled reward when it was saved; the trained checkpoint's train "
        "reward over its last 10% of steps. Weights: sha256 of the parameters (16 hex digits), as "
        "measured.",
        "",
        markdown_table(
            ["task", "checkpoint", "source", "reward", "weights"], list(checkpoints.values()), False
        ),
        "",
        *_second_pass(main),
    ]


def _second_pass(main: dict) -> list[str]:
    """Cells whose gradients did not all fit on disk: how many batches were measured again (by a helper
    process too) and how far the re-measured norms moved from the first pass (0: bit for bit)."""
    rows = [
        [
            f"{c.task} {c.checkpoint} N={c.n}",
            st["stored_batches"],
            st["recomputed_batches"],
            st.get("recomputed_by_helper", 0),
            f"{st['recomputed_max_relative_difference']:.1e}",
        ]
        for c, r in main.items()
        if (st := r.get("storage")) and st["recomputed_batches"]
    ]
    if not rows:
        return []
    head = ["cell", "kept on disk", "measured again", "of which by a helper", "largest relative difference"]
    return [
        "## Cells measured in two passes",
        "",
        "Their gradients did not all fit on disk, so the batches beyond the disk's share were measured again "
        "from their seeds for their sums (`studies/cell_sums.py`; a helper process shares that pass). Each "
        "re-measured batch must repeat its first-pass norms within 1e-6; the largest relative difference:",
        "",
        markdown_table(head, rows, False),
        "",
    ]


def _bucket_reading(stats: dict) -> str:
    """One descriptive sentence on the buckets (counted from the table; no test, no verdict)."""
    pairs = [(s["buckets"]["early"]["ratio"], s["buckets"]["late"]["ratio"]) for s in stats.values()]
    lower = sum(late.ratio < early.ratio for early, late in pairs)
    below = {
        b: sum(math.isfinite(iv.hi) and iv.hi < 1 for iv in (p[i] for p in pairs))
        for i, b in enumerate(("early", "late"))
    }
    return (
        f"Read descriptively (the protocol tests no bucket): the late-token ratio is below the early-token "
        f"ratio in {lower} of {len(pairs)} cells; the interval lies below 1 for the early tokens in "
        f"{below['early']} and for the late tokens in {below['late']} of them."
    )


def _pilot_section(study: Any, pilot: dict, power_plan: Any, cell_stats: Any) -> list[str]:
    rule = study.pilot["power"]
    lines = [
        "## Pilot and power calculation",
        "",
        "Pilot: its own batch seeds, K = "
        + ", ".join(f"{t}: {k}" for t, k in study.pilot["k"].items())
        + " per cell; never part of the verdict.",
        "",
    ]
    if len(pilot) < len(study.cells()):
        rows = [
            [
                f"{c.task} {c.checkpoint} N={c.n}",
                len(r["batches"]),
                _iv(cell_stats(r)["buckets"]["all"]["ratio"]),
            ]
            for c, r in pilot.items()
        ]
        return [*lines, markdown_table(["cell", "K", "ratio"], rows), "", "Pilot incomplete.", ""]
    plan = power_plan(study, pilot)
    rows = [
        [
            name,
            row["pilot_k"],
            _iv(row["ratio"]),
            f"{row['sd']:.2f}" if math.isfinite(row["sd"]) else "-",
            f"{row['sd_planned']:.2f}" + (" (borrowed)" if row["borrowed"] else ""),
            f"{row['cpu_per_batch']:.2f}",
            row["k_needed"],
            row["k"],
            f"{row['power']:.3f}",
        ]
        for name, row in plan["cells"].items()
    ]
    fits = plan["scale"] >= 1
    return [
        *lines,
        f"Rule (registered): assumed true ratio {plan['planned_ratio']} in every cell; SD of log(ratio) "
        f"per batch = jackknife SE x √K, planned at its one-sided {rule['sd_level']} upper confidence "
        f"limit; K per cell reaches power {plan['per_cell_target']:.4f} (joint {rule['target']} over "
        f"{len(plan['cells'])} independent cells); budget {plan['budget_cpu_seconds'] / 60:.0f} min of "
        "single-thread CPU for the main runs, at the pilot's CPU seconds per batch; beyond it every K is "
        "scaled by one factor.",
        "",
        markdown_table(
            [
                "cell",
                "pilot K",
                "pilot ratio",
                "SD",
                "SD planned",
                "CPU s/batch",
                "K needed",
                "K",
                "power at K",
            ],
            rows,
        ),
        "",
        f"The K needed would take {plan['needed_cpu_seconds'] / 60:.0f} min of CPU: "
        + (
            "within the budget."
            if fits
            else f"over the budget, so every K was scaled by {plan['scale']:.3f} (planned "
            f"{plan['planned_cpu_seconds'] / 60:.0f} min)."
        )
        + " Joint power at these K (every cell's interval below 1 if the true ratio is "
        f"{plan['planned_ratio']} everywhere): **{plan['joint_power']:.2f}**.",
        "",
    ]
