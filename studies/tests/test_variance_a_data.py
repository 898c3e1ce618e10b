"""The committed page of claim (a)'s registered variance study (docs/results/variance-a.md) comes back
byte for byte from the committed per-batch data alone (`python -m studies variance-a --no-run`), and the
verdict row for claims.md (`variance_a.mechanism_claim`) reads the same data. The figure is compared by
presence only (its bytes depend on matplotlib's version)."""

from __future__ import annotations

import shutil
from pathlib import Path

from studies import variance_a
from studies.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_page_rebuilds_from_the_committed_data(tmp_path, capsys) -> None:
    data = RESULTS / variance_a.NAME
    assert (data / "pilot" / "protocol.json").is_file(), "no committed data of the study"
    shutil.copytree(data, tmp_path / variance_a.NAME)
    main(["variance-a", "--no-run", "--results", str(tmp_path)])
    capsys.readouterr()
    page = (tmp_path / f"{variance_a.NAME}.md").read_text()
    assert page == (RESULTS / f"{variance_a.NAME}.md").read_text()
    if (data / "main" / "protocol.json").is_file():
        assert (tmp_path / f"{variance_a.NAME}.png").is_file()


def test_claim_row_reads_the_committed_data() -> None:
    claim = variance_a.mechanism_claim(RESULTS)
    assert claim is not None and claim.claim == variance_a.CLAIM
    page = (RESULTS / f"{variance_a.NAME}.md").read_text()
    assert f"Verdict: **{claim.verdict}**" in page
    assert claim.protocol in page
