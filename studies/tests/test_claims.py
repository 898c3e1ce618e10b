"""claims.md: verdicts follow the stated rules on synthetic study results, and a study that has not
been run is reported as such instead of guessed."""

from __future__ import annotations

import json

import pytest

from studies.claims import comparison_rows, lr_decay_row, stability_row, write_claims


def _variance(otb: list[float], mean: list[float]) -> dict:
    """A variance study whose paired NSR ratio otb / mean has a narrow interval around it at N = 4, 8."""
    per_n = {
        str(n): {
            "stats": {"otb": {"rel_var": o, "nsr": 1.0}, "dr_grpo": {"rel_var": m, "nsr": 1.0}},
            "nsr_ratios": {"otb / dr_grpo": {"ratio": o / m, "lo": 0.9 * o / m, "hi": 1.1 * o / m, "k": 24}},
        }
        for n, o, m in zip((4, 8), otb, mean, strict=True)
    }
    return {"per_n": per_n, "correlations": {}}


def _ci(mean: float, lo: float, hi: float, n: int = 5) -> dict:
    return {"mean": mean, "lo": lo, "hi": hi, "n": n, "confidence": 0.95}


def _comparison(name: str, kind: str, cand: str, base: str, heldout: list, verdict: str, **extra) -> dict:
    return {
        "name": name,
        "claim": f"claim {name}",
        "kind": kind,
        "candidate": cand,
        "baseline": base,
        "margin": extra.pop("margin", 0.0),
        "heldout": heldout,
        "tokens": extra.pop("tokens", []),
        "verdict": verdict,
        **extra,
    }


def _walk_result() -> dict:
    spreads = {
        "length_cv_start": [0.5, 0.56],
        "energy_cv_start": [1.0, 1.2],
        "reward_spread_start": [0.9, 0.9],
    }
    arms = {a: {**spreads, "start": [0.3, 0.32], "final": [0.5, 0.52]} for a in ("otb-N4", "grpo-N4")}
    held = [
        {"budget": 100000, "baseline_budget": 100000, "interval": _ci(0.03, 0.01, 0.05), "verdict": "held"}
    ]
    tokens = [
        {
            "threshold": 0.45,
            "interval": _ci(12000.0, -3000.0, 27000.0),
            "verdict": "inconclusive",
            "reached": [5, 4],
        }
    ]
    matches = [
        {
            "budget": 300000,
            "baseline_budget": 900000,
            "interval": _ci(-0.01, -0.05, 0.03, n=3),
            "verdict": "inconclusive",
        }
    ]
    return {
        "arms": arms,
        "comparisons": [
            _comparison(
                "OTB vs GRPO, N=4", "better", "otb-N4", "grpo-N4", held, "inconclusive", tokens=tokens
            ),
            _comparison("big", "matches", "otb-N4", "grpo-N32", matches, "inconclusive", margin=0.03),
        ],
    }


def test_comparison_rows_state_intervals_rule_and_horizon() -> None:
    first, second = comparison_rows(_walk_result(), "walk")
    claim, measured, verdict, command = first
    assert claim == "claim OTB vs GRPO, N=4" and command == "`python -m studies compare walk`"
    assert "within-group length CV 0.53" in measured and "energy CV 1.10" in measured
    assert "held-out reward @100k: +0.030 [+0.010, +0.050] (n=5)" in measured
    assert (
        "tokens saved to train reward 0.45: +12.0k [-3.0k, +27.0k] (n=5) (reached by otb-N4 in 5 seeds, "
        "by grpo-N4 in 4)"
    ) in measured
    assert "paired over 5 seeds" in measured and "otb-N4 train reward 0.31 → 0.51" in measured
    assert verdict.startswith("**inconclusive** (rule: held if the 95% t interval")
    assert "@300k vs 900k: -0.010 [-0.050, +0.030] (n=3)" in second[1] and "paired over 3 seeds" in second[1]
    assert "above -0.03" in second[2]


def _ladder_arm(collapses: list, seeds=(0, 1), decays=None) -> dict:  # noqa: ANN001
    return {
        "seed_list": list(seeds),
        "collapses": collapses,
        "surges": 0,
        "clip_fraction": [0.1, 0.2],
        "decays": decays or [[] for _ in seeds],
    }


def _ladder(otb: list[list], mean: list[list], decay: list | None = None, fired: bool | list = True) -> dict:
    arms = {}
    for lr, o, m in zip((1e-4, 2e-4, 4e-4), otb, mean, strict=True):
        arms[f"otb-N4@{lr:g}"] = _ladder_arm(o)
        arms[f"dr_grpo-N4@{lr:g}"] = _ladder_arm(m)
        arms[f"grpo-N4@{lr:g}"] = _ladder_arm(m)
    if decay is not None:
        triggers = fired if isinstance(fired, list) else [[5], []] if fired else [[], []]
        arms["dr_grpo-N4-length_decay@0.0004"] = _ladder_arm(decay, decays=triggers)
        arms["otb-N4-length_decay@0.0004"] = _ladder_arm(decay, decays=triggers)
    return {"arms": arms}


def test_stability_verdicts_from_the_ladder() -> None:
    calm = [[None, None]] * 3
    falls = [[None, None], [12, 20], [8, 9]]  # collapses at 2e-4 and 4e-4
    row = stability_row(_ladder(calm, falls))
    assert row[2].startswith("**held**")  # 4 of 6 (rung, seed) pairs favour OTB, none against
    assert "otb-N4: collapsed 0/2 @ 0.0001, 0/2 @ 0.0002, 0/2 @ 0.0004; critical lr none" in row[1]
    assert "dr_grpo-N4: collapsed 0/2 @ 0.0001, 2/2 @ 0.0002, 2/2 @ 0.0004; critical lr 0.0002" in row[1]
    assert stability_row(_ladder(falls, falls))[2].startswith("**inconclusive**")  # every difference 0
    assert stability_row(_ladder(calm, calm))[2].startswith("**not tested**")
    assert stability_row(_ladder(falls, calm))[2].startswith("**did not hold**")


def test_lr_decay_row() -> None:
    falls = [[None, None], [12, 20], [8, 9]]
    kept = _ladder(falls, falls, decay=[None, None])
    assert lr_decay_row(kept)[2].startswith("**held**")
    assert "dr_grpo-N4 collapsed 2/2 @ 0.0004, with the decay 0/2" in lr_decay_row(kept)[1]
    silent = _ladder(falls, falls, decay=[None, None], fired=False)
    assert lr_decay_row(silent)[2].startswith("**not tested**")
    same = _ladder(falls, falls, decay=[8, 9])
    assert lr_decay_row(same)[2].startswith("**inconclusive**")
    assert (
        "1 LR-decay triggers, in 1 of the 2 runs whose base collapsed before that collapse"
        in (lr_decay_row(same)[1])
    )
    late = _ladder(falls, falls, decay=[8, 9], fired=[[8], [12]])  # at / after the base's collapse (8, 9)
    row = lr_decay_row(late)
    assert "2 LR-decay triggers, in 1 of the 2 runs" in row[1]  # step 8 is still in time; step 12 is not
    too_late = _ladder(falls, falls, decay=[8, 9], fired=[[9], [12]])
    assert lr_decay_row(too_late)[2].startswith("**not tested**")


def test_write_claims_reports_what_is_missing(tmp_path) -> None:
    (tmp_path / "variance.json").write_text(json.dumps(_variance([0.5, 0.8], [1.0, 1.0])))
    (tmp_path / "walk.json").write_text(json.dumps(_walk_result()))
    text = write_claims(tmp_path).read_text()
    assert "| (a) OTB lowers" in text and "| claim OTB vs GRPO, N=4 |" in text
    assert "Not run yet: ladder, smollm2, smollm2c, tir, tir2, variance-walk, walk3." in text
    # decided before the runs, listed whether or not they have run: smollm2c's N=32 comparison
    assert "Left out of the claims before their runs, and why:" in text
    assert "- `smollm2c`: OTB at N=4 against GRPO at N=32 (the paper's claim b): smollm2's N=32" in text
    assert "Stopped at the pilot" not in text  # no walk2-pilot.md here
    (tmp_path / "walk2-pilot.md").write_text("# walk2 pilot\n")
    assert "Stopped at the pilot: `walk2` (its pilot failed" in write_claims(tmp_path).read_text()
    assert "[walk.md](walk.md)" in text and "[tir.md]" not in text
    # a result without a registration is flagged as legacy, with its held-out overlap computed
    assert "**Legacy result**" in text and "of its held-out prompts were also training prompts" in text
    assert "- `walk`: made before protocols were registered" in text


def _registered(result: dict, amendments: list | None = None, stamps: dict | None = None) -> dict:
    reg = {
        "hash": "h1",
        "registered": "2026-01-01T00:00:00+00:00",
        "committed": True,
        "commit": "c" * 40,
        "amendments": amendments or [],
    }
    return {**result, "registration": reg, "protocols": stamps or {"h1": 4}}


def test_registered_results_are_clean_and_amendments_are_listed(tmp_path) -> None:
    clean = comparison_rows(_registered(_walk_result()), "walk")[0]
    assert "Legacy" not in clean[1] and "amended" not in clean[1]
    amended = _registered(
        _walk_result(),
        [{"hash": "h2", "at": "2026-01-02T00:00:00+00:00", "reason": "more seeds", "changed": ["seeds"]}],
        {"h1": 2, "h2": 2},
    )
    row = comparison_rows(amended, "walk")[0]
    assert "protocol amended after its first run started" in row[1] and "2 under h1" in row[1]
    (tmp_path / "walk.json").write_text(json.dumps(amended))
    assert "- `walk`: amended at 2026-01-02T00:00:00+00:00 (keys seeds): more seeds" in (
        write_claims(tmp_path).read_text()
    )


def test_primary_endpoint_and_phenomenon_in_the_rows(tmp_path) -> None:
    res = _walk_result()
    c = res["comparisons"][0]
    c["primary"] = 100000
    c["heldout"][0]["primary"] = True
    c["verdict"] = "held"  # as compare_arms reads it: the primary (held) decides, tokens (inconclusive) not
    row = comparison_rows(_registered(res), "walk")[0]
    assert "held-out reward @100k (primary)" in row[1] and "the primary endpoint decides" in row[2]
    path = tmp_path / "walkp.yaml"
    from studies.experiment import EXPERIMENTS

    path.write_text((EXPERIMENTS / "walk.yaml").read_text() + "phenomenon: {length_cv_run: 0.3}\n")
    for arm in res["arms"].values():
        arm["length_cv_run"] = [0.2, 0.25]
    low = comparison_rows(_registered(res), str(path))[0]
    assert low[2].startswith("**not tested**") and "length_cv_run 0.225 < 0.3" in low[2]
    for arm in res["arms"].values():
        arm["length_cv_run"] = [0.4, 0.5]
    assert comparison_rows(_registered(res), str(path))[0][2].startswith("**held**")
    # an experiment whose seeds came from a power calculation: the verdict is read at the power stated
    path.write_text(path.read_text() + "power: {seeds: 3, seeds_needed: [3, 2]}\n")
    verdict = comparison_rows(_registered(res), str(path))[0][2]
    assert verdict.endswith(
        "3 seeds a compared arm, planned for 80% power to say held at a true difference of +0.03 (the "
        "pilot's variance called for 3))"
    )


def test_the_real_model_verdict_is_read_first_and_supersedes_smollm2(tmp_path) -> None:
    res = _walk_result()
    res["comparisons"] = res["comparisons"][:1]  # otb-N4 − grpo-N4, both arms of smollm2c
    for name in ("smollm2", "smollm2c"):
        (tmp_path / f"{name}.json").write_text(json.dumps(_registered(res)))
    text = write_claims(tmp_path).read_text()
    rows = [line for line in text.splitlines() if line.startswith("| claim OTB vs GRPO")]
    assert len(rows) == 1 and rows[0].endswith("| `python -m studies compare smollm2c` |")
    posed = "; each held-out score over 256 distinct held-out problems x 4 samples; otb-N4 − grpo-N4"
    assert posed in rows[0]
    assert "Superseded: [smollm2.md](smollm2.md) by [smollm2c.md](smollm2c.md)." in text
    assert "smollm2c" not in text.split("Not run yet: ")[-1]


def test_a_successor_in_progress_has_no_verdict_no_p_value_and_supersedes_nothing(tmp_path) -> None:
    """Issue 34: smollm2c's 93 seeds take many sessions. Until every planned seed has run, its rows read
    "in progress" (no verdict word, so the README's headline carries none), stay out of Holm's family, and
    smollm2's finished rows stay; once it is complete it supersedes smollm2."""
    res = _walk_result()
    res["comparisons"] = res["comparisons"][:1]
    for arm in res["arms"].values():  # the phenomenon over whole runs, which smollm2c's protocol reads
        arm["length_cv_run"] = [0.5, 0.56]
    (tmp_path / "smollm2.json").write_text(json.dumps(_registered(res)))
    looking = {**res, "comparisons": [{**res["comparisons"][0], "interim": "interim: 2 of 93 planned seeds"}]}
    (tmp_path / "smollm2c.json").write_text(json.dumps(_registered(looking)))
    text = write_claims(tmp_path).read_text()
    rows = [line for line in text.splitlines() if line.startswith("| claim OTB vs GRPO") and "(rule:" in line]
    assert len(rows) == 2 and rows[0].endswith("| `python -m studies compare smollm2c` |")
    assert "| **in progress, interim: 2 of 93 planned seeds** (rule:" in rows[0]
    assert rows[1].endswith("| `python -m studies compare smollm2` |")  # smollm2's finished row stays
    assert "in progress" not in rows[1] and "| **inconclusive** (rule:" in rows[1]
    assert "Superseded" not in text and "smollm2c" not in text.split("Not run yet: ")[-1]
    holm = text.split("**Multiplicity.**")[1].split("**Protocol changes")[0]
    assert "compare smollm2`" in holm and "compare smollm2c`" not in holm
    (tmp_path / "smollm2c.json").write_text(json.dumps(_registered(res)))  # every planned seed has run
    text = write_claims(tmp_path).read_text()
    assert "Superseded: [smollm2.md](smollm2.md) by [smollm2c.md](smollm2c.md)." in text
    assert "compare smollm2c`" in text.split("**Multiplicity.**")[1].split("**Protocol changes")[0]


def test_censored_runs_are_read_both_ways_in_the_ladder_verdict() -> None:
    calm = [[None, None]] * 3
    falls = [[None, None], [12, 20], [8, 9]]
    res = _ladder(calm, falls)
    for arm, a in res["arms"].items():
        a["censored"] = [arm == "otb-N4@0.0004", arm == "otb-N4@0.0004"]  # OTB ends low at the top rung
        a["held_out"] = [0.3, 0.3]
    row = stability_row(res)
    assert "0/2 @ 0.0004 (+2 censored)" in row[1] and "censored runs of these arms counted" in row[1]
    assert row[2].startswith("**inconclusive**: censoring decides (held if censored runs survived")
    assert "final held-out reward 0.30 @ 0.0001" in row[1]
    for a in res["arms"].values():
        a["censored"] = [False, False]
    assert stability_row(res)[2].startswith("**held**")


def test_a_missing_role_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("recipe: demo\nseeds: [0]\nladder: [1.0e-4]\narms: {a: {}}\nroles: {candidate: a}\n")
    with pytest.raises(ValueError, match="no arm has the role 'group_mean'.*roles:"):
        stability_row({"arms": {}}, str(path))
    with pytest.raises(ValueError, match="no arm has the role 'lr_decay'"):
        lr_decay_row({"arms": {}}, str(path))


def test_the_readme_evidence_section_is_claims_md(tmp_path) -> None:
    from studies.claims import BEGIN, END, readme_block, sync_readme

    (tmp_path / "walk.json").write_text(json.dumps(_walk_result()))
    page = write_claims(tmp_path)
    readme = tmp_path.parent / "README.md"
    readme.write_text(f"# x\n\n## Evidence\n\n{BEGIN}\nold text\n{END}\n\n## Next\n")
    sync_readme(readme, page)
    text = readme.read_text()
    assert "old text" not in text and text.endswith(f"{END}\n\n## Next\n")
    # the headline: each claim with its experiment and verdict word, linked to claims.md for the rest
    assert f"[claims.md]({tmp_path.name}/claims.md)" in text
    assert "| claim OTB vs GRPO, N=4 | `walk` | **" in text
    assert "rule:" not in text.split(BEGIN)[1]  # the rules and measurements stay in claims.md
    assert text.split(BEGIN)[1].split(END)[0].strip() == readme_block(page, readme)
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no evidence section markers"):
        sync_readme(readme, page)


def test_the_shipped_readme_states_what_claims_md_states() -> None:
    from pathlib import Path

    from studies.claims import BEGIN, END, readme_block

    root = Path(__file__).resolve().parents[2]
    readme, page = root / "README.md", root / "docs" / "results" / "claims.md"
    section = readme.read_text().split(BEGIN)[1].split(END)[0].strip()
    assert section == readme_block(page, readme), "run `python -m studies claims --readme README.md`"


def test_the_gap_section_reads_each_same_n_control_by_its_verdict(tmp_path):
    """Claim (b) needs a gap (issue 33): a control that passes the matches test means no gap, one that
    fails means a gap, an inconclusive one shows neither."""
    from studies.claims import gap_section

    def control(arm: str, verdict: str) -> dict:
        iv = {"mean": -0.05, "lo": -0.06, "hi": -0.04, "n": 5, "confidence": 0.95}
        return {
            "arm": arm,
            "verdict": verdict,
            "heldout": [{"primary": True, "budget": 400, "baseline_budget": 1200, "interval": iv}],
        }

    res = {
        "comparisons": [
            {
                "baseline": "grpo-N32",
                "controls": [
                    control("grpo-N4", "held"),
                    control("dr_grpo-N4", "did not hold"),
                    control("rloo-N4", "inconclusive"),
                ],
            }
        ]
    }
    lines = gap_section({"x": res, "empty": None}, tmp_path)
    text = "\n".join(lines)
    assert "grpo-N4 − grpo-N32" in text and "cannot single out OTB" in text
    assert "dr_grpo-N4 − grpo-N32" in text and "(a gap)" in text
    assert "rloo-N4 − grpo-N32" in text and "no gap shown either way" in text
    assert gap_section({"x": {"comparisons": [{"baseline": "b"}]}}, tmp_path) == []  # no pilot records there


def test_the_readme_names_a_registered_study_by_its_study(tmp_path):
    from studies.claims import readme_block

    claims = tmp_path / "claims.md"
    claims.write_text(
        "# c\n\n| claim | measured | verdict | command |\n|---|---|---|---|\n"
        "| (a) x | m | **held** (rule: r) | `python -m studies variance-a --no-run` |\n"
        "| (a) x | m | **not tested, interim: 2 of 8 cells measured** (rule: r) "
        "| `python -m studies variance-a --study variance-b --no-run` |\n"
        "| b | m | **inconclusive** (rule: r) | `python -m studies compare walk3` |\n"
    )
    block = readme_block(claims, tmp_path / "README.md")
    assert "| (a) x | `variance-a` | **held** |" in block
    assert "| (a) x | `variance-b` | **not tested, interim: 2 of 8 cells measured** |" in block
    assert "| b | `walk3` | **inconclusive** |" in block


def test_the_gap_pilot_reads_as_its_pilot_page_does():
    """claims.md's reading of a pilot that tested the gap (walk4: GRPO N=32 at 1.2M against N=4 at 400k)
    carries the numbers and the pass/fail of the pilot page's gap row, both from the committed records."""
    from pathlib import Path

    from studies.claims import gap_pilots

    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    page = (results / "walk4-pilot.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| gap: grpo-N32 − grpo-N4"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    (name, line, passed), *_ = [g for g in gap_pilots(results) if g[0] == "walk4"]
    assert passed is (cells[-1] == "**passed**")
    assert f"grpo-N32 at 1200k tokens {cells[3]} against grpo-N4 at 400k tokens {cells[2]}" in line
    assert f"a difference of {cells[4]}" in line and ("**failed**" in line) is (not passed)
