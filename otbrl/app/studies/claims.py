"""`docs/results/claims.md`: one row per claim of the OTB paper (and two questions of ours), with what we
measured and a verdict computed from the studies' JSON results by the rules stated next to each row.
The rows on the variance study are in `variance_claims`, those on training runs in `training_claims`; a
study not yet run says so instead of guessing.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otbrl.app.studies.report import markdown_table
from otbrl.app.studies.training_claims import Row, comparison_rows, lr_decay_row, stability_row
from otbrl.app.studies.variance_claims import proxy_claim, variance_claim


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def loo_question(var: dict[str, Any]) -> Row:
    """(ours) leave-one-out against self-inclusive OTB, by noise-to-signal at each N."""
    r = []
    for n, block in sorted(var["per_n"].items(), key=lambda kv: int(kv[0])):
        s = block["stats"]
        if "otb" in s and "otb_loo" in s:
            r.append(f"N={n}: {s['otb_loo']['nsr']:.2f} vs {s['otb']['nsr']:.2f}")
    return (
        "(ours) Does the unbiased leave-one-out OTB beat the paper's self-inclusive form?",
        "noise-to-signal, leave-one-out vs self-inclusive: " + ", ".join(r) + "." if r else "not measured",
        "see the numbers: leave-one-out is unbiased by construction; the question is its noise",
        "`otbrl variance`",
    )


STUDIES = {  # results JSON -> the command that writes it
    "variance": "otbrl variance",
    "variance-walk": "otbrl variance --task walk --name variance-walk",
    "walk": "otbrl compare walk",
    "walk2": "otbrl compare walk2",
    "ladder": "otbrl compare ladder",
    "tir": "otbrl compare tir",
}


# an experiment -> the one that replaces it: once the successor has results, the old rows move to the
# superseded list (the old page stays, and says why)
SUCCESSORS = {"walk": "walk2"}


def protocol_changes(results: Path) -> list[str]:
    """One line per protocol change made after an experiment's first run started: amendments recorded in
    its registration, and the legacy results made before registration existed."""
    from otbrl.app.studies.training_claims import LEGACY

    lines = []
    for name in STUDIES:
        res = _load(results, name)
        if res is None or "arms" not in res or name.startswith("variance"):
            continue
        reg = res.get("registration")
        if reg is None:
            lines.append(f"- `{name}`: made before protocols were registered; " + LEGACY.get(name, "see git"))
            continue
        for a in reg.get("amendments", []):
            lines.append(f"- `{name}`: amended at {a['at']} (keys {', '.join(a['changed'])}): {a['reason']}")
        if reg.get("committed") is False:
            lines.append(f"- `{name}`: its YAML was not committed when its first run started")
    for folder in sorted((results / "runs").glob("*-pilot")):
        reg = _load_json(folder / "protocol.json")
        for a in (reg or {}).get("amendments", []):
            lines.append(f"- `{folder.name}`: amended at {a['at']} (keys {', '.join(a['changed'])}): "
                         f"{a['reason']}")  # fmt: skip
    return lines


def _load_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def write_claims(results: Path = Path("docs/results")) -> Path:
    var, var_walk, walk, walk2, ladder, tir = (_load(results, n) for n in STUDIES)
    superseded = [old for old, new in SUCCESSORS.items() if _load(results, new) is not None]
    if "walk" in superseded:
        walk = None
    rows: list[Row] = []
    missing: list[str] = []

    def add(study: dict[str, Any] | None, name: str, fn: Callable[[dict[str, Any]], Any]) -> None:
        if study is None:
            missing.append(name)
            return
        out = fn(study)
        rows.extend(out if isinstance(out, list) else [out])

    add(var, "variance", variance_claim)
    add(var_walk, "variance-walk", variance_claim)
    add(var, "variance", proxy_claim)
    add(var_walk, "variance-walk", proxy_claim)
    if "walk" not in superseded:
        add(walk, "walk", lambda r: comparison_rows(r, "walk"))
    add(walk2, "walk2", lambda r: comparison_rows(r, "walk2"))
    add(ladder, "ladder", stability_row)
    add(tir, "tir", lambda r: comparison_rows(r, "tir"))
    add(ladder, "ladder", lr_decay_row)
    if var is not None:
        rows.append(loo_question(var))
    lines = [
        "# The paper's claims, measured here",
        "",
        "Tiny Qwen2 models (0.5M parameters) on built-in tasks, on a 2-core CPU: a small-scale check of the "
        "mechanisms, not of the paper's 7B numbers. Each row's verdict follows the rule stated in it, "
        "applied to the numbers in the linked pages; regenerate this page with `otbrl claims` after the "
        "studies. Verdicts: **held**, **did not hold**, **inconclusive** (the interval spans the decision "
        "point) or **not tested** (the phenomenon did not occur, or too few seeds pair up).",
        "",
        markdown_table(["claim", "measured", "verdict", "command"], rows, aligned=False),
        "",
        "Details: " + ", ".join(f"[{n}.md]({n}.md)" for n in STUDIES if _load(results, n) is not None) + "."
        + (" When the length-surge detector would have fired relative to the ladder's collapses (a replay "
           "on the base runs' lengths): [decay_timing.md](decay_timing.md)."
           if (results / "decay_timing.md").is_file() else ""),
        "",
        "Each row's interval is a 95% t confidence interval over paired seeds; in the linked pages' arm "
        "tables, \"±\" is the standard deviation across seeds, not an interval.",
        "",
        "**Protocol changes after a first run started.**",
        "",
        "\n".join(protocol_changes(results)) or "None.",
        "",
        "Every experiment's protocol (its YAML but the description and quick section) is registered with "
        "its hash when its first run starts (`docs/results/runs/<experiment>/protocol.json`) and stamped "
        "on every run's committed record; `otbrl compare` refuses a changed protocol unless the change is "
        "recorded with `--amend REASON`, and every such amendment is listed here.",
        "",
        "Withdrawn: round 1's `efficiency`, `efficiency48` and `stress` experiments (fixed-length answers, "
        "one learning rate for every arm, unequal step budgets, 3 seeds, no intervals; see issue 16). "
        "Their pages are in the git history.",
    ]
    if superseded:
        pairs = [f"[{o}.md]({o}.md) by [{SUCCESSORS[o]}.md]({SUCCESSORS[o]}.md)" for o in superseded]
        lines += ["", "Superseded: " + ", ".join(pairs) + "."]
    if missing:
        lines += ["", "Not run yet: " + ", ".join(sorted(set(missing))) + "."]
    out = results / "claims.md"
    out.write_text("\n".join(lines) + "\n")
    return out


BEGIN, END = "<!-- claims.md begins: written by `otbrl claims --readme` -->", "<!-- claims.md ends -->"


def readme_block(claims_md: Path, readme: Path) -> str:
    """claims.md without its title, links made relative to the README's folder."""
    body = claims_md.read_text().split("\n", 1)[1].strip()
    prefix = os.path.relpath(claims_md.parent, readme.parent).replace(os.sep, "/")
    return re.sub(r"\]\(([\w.-]+\.(?:md|png))\)", lambda m: f"]({prefix}/{m.group(1)})", body)


def sync_readme(readme: Path, claims_md: Path) -> None:
    """Put claims.md into the README between the BEGIN and END markers, so both say the same."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme}: no evidence section markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{readme_block(claims_md, readme)}\n{END}{tail}")
