"""Every committed results page that the suite writes from run records comes back byte for byte when it is
rebuilt from those records alone (`python -m studies compare NAME --no-run`, `--pilot --no-run`,
`phenomenon NAME` where its page is committed, then `claims`): what the pages say is what the committed
records and today's code say. Figures are rebuilt too, but compared by presence only (their bytes depend
on matplotlib's version, which the project does not pin).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from studies.cli import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _experiments() -> tuple[list[str], list[str]]:
    """(experiments, pilots) that have committed run records."""
    # a folder may hold step-0 scores committed ahead of its runs (`studies step0`), and no record yet
    names = sorted(p.name for p in (RESULTS / "runs").iterdir() if any(p.glob("*/seed*.json.gz")))
    pilots = [n.removesuffix("-pilot") for n in names if n.endswith("-pilot")]
    return [n for n in names if not n.endswith("-pilot")], pilots


def test_every_page_regenerates_unchanged_from_the_committed_records(tmp_path, monkeypatch, capsys):
    experiments, pilots = _experiments()
    assert experiments and pilots, "no committed run records found"
    copy = tmp_path / "docs" / "results"
    shutil.copytree(RESULTS, copy)
    pages = [p for p in copy.glob("*") if p.suffix in (".md", ".json")]
    before = {p.name: p.read_bytes() for p in pages}
    own = [n for n in experiments if (copy / f"{n}-phenomenon.md").is_file()]  # `studies phenomenon`
    for p in pages:  # whatever the rebuild does not write again stays missing and fails below
        stem = p.stem.removesuffix("-pilot").removesuffix("-phenomenon")
        if stem in experiments + pilots or p.name in ("claims.md",):
            p.unlink()
    monkeypatch.chdir(tmp_path)  # the pages name the results folder as the commands were given it
    for name in experiments:
        main(["compare", name, "--no-run"])
    for name in pilots:
        main(["compare", name, "--pilot", "--no-run"])
    for name in own:
        main(["phenomenon", name])
    main(["claims"])
    capsys.readouterr()
    changed = sorted(
        n for n, blob in before.items() if not (copy / n).is_file() or (copy / n).read_bytes() != blob
    )
    assert not changed, f"rebuilt pages differ from the committed ones: {changed}"
    for name in experiments:
        assert (copy / f"{name}.png").is_file(), name


def test_a_record_commit_rebuilds_a_committed_phenomenon_page(tmp_path, monkeypatch):
    """`compare --commit` rebuilds the phenomenon page of its experiment with each record, where one is
    committed (`cli.rebuild_pages`), so the page never lags the records it reads."""
    from studies.cli import rebuild_pages

    own = sorted(RESULTS.glob("*-phenomenon.md"))
    assert own, "no committed phenomenon page"
    name = own[0].name.removesuffix("-phenomenon.md")
    copy = tmp_path / "docs" / "results"
    shutil.copytree(RESULTS, copy)
    (copy / own[0].name).write_text("stale\n")
    monkeypatch.chdir(tmp_path)
    files = rebuild_pages(name, copy, pilot_stage=False)()
    assert copy / own[0].name in files and (copy / own[0].name).read_bytes() == own[0].read_bytes()
