"""The committed page of each registered study of claim (a) (docs/results/variance-a.md, variance-b.md)
comes back byte for byte from the committed per-batch data alone (`python -m studies variance-a [--study
NAME] --no-run`), and the verdict row for claims.md (`variance_a.mechanism_claim`) reads the same data.
The figure is compared by presence only (its bytes depend on matplotlib's version)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from studies import variance_a
from studies.cli import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
REGISTERED = [n for n in variance_a.STUDIES if (RESULTS / n / "main" / "protocol.json").is_file()]


@pytest.mark.parametrize("name", REGISTERED)
def test_page_rebuilds_from_the_committed_data(name, tmp_path, capsys) -> None:
    for study in variance_a.STUDIES:  # a study may read its predecessor's pilot (pilot_from)
        if (RESULTS / study).is_dir():
            shutil.copytree(RESULTS / study, tmp_path / study)
    main(["variance-a", "--study", name, "--no-run", "--results", str(tmp_path)])
    capsys.readouterr()
    page = (tmp_path / f"{name}.md").read_text()
    assert page == (RESULTS / f"{name}.md").read_text()
    if list((RESULTS / name / "main").glob("*.json.gz")):
        assert (tmp_path / f"{name}.png").is_file()


def test_variance_a_is_registered_with_data() -> None:
    assert "variance-a" in REGISTERED and (RESULTS / "variance-a" / "pilot" / "protocol.json").is_file()


@pytest.mark.parametrize("name", REGISTERED)
def test_claim_row_reads_the_committed_data(name) -> None:
    claim = variance_a.mechanism_claim(RESULTS, variance_a.protocol_path(name))
    assert claim is not None and claim.claim == variance_a.CLAIM
    page = (RESULTS / f"{name}.md").read_text()
    assert f"Verdict: **{claim.verdict}**" in page
    assert claim.protocol in page
