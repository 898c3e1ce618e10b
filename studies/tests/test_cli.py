"""The suite's command, `python -m studies`: its subcommands run from any directory, fail in one line, and
refuse argument combinations that would not do what they say."""

from __future__ import annotations

import pytest

from studies.cli import main


def test_claims_and_variance_from_an_unrelated_directory(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from studies import variance

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["claims"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("studies: nothing to summarise: no study results (")
    assert "runs/compare-quick/results" in err
    # variance --quick writes under the current directory, not a fixed folder of the system temp dir.
    seen = []
    monkeypatch.setattr(variance, "main", lambda args, verdicts: seen.append(args.out))
    main(["variance", "--quick"])
    main(["variance", "--quick", "--out", "elsewhere"])
    assert seen == [Path("runs/variance-quick"), Path("elsewhere")]


def test_compare_seeds_take_lists_and_ranges_and_refuse_the_rest(capsys):
    from otbrl.app.cli import int_list

    assert int_list("3,9-11") == [3, 9, 10, 11] and int_list("7") == [7]
    with pytest.raises(SystemExit):
        main(["compare", "walk3", "--seeds", "9-x"])
    assert "integers or ranges" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--seeds chooses reported runs"):
        main(["compare", "walk3", "--pilot", "--seeds", "1"])
    with pytest.raises(SystemExit, match="--no-run trains none"):
        main(["compare", "walk3", "--no-run", "--arms", "otb-N4"])


def test_commit_leaves_the_pages_as_the_records_commits_hold_them(tmp_path, monkeypatch, capsys):
    """`compare --commit` (a worktree's runs committed into the main checkout): the page the invocation
    writes last, with this machine's refusals and timing, is replaced by the rebuild from the records that
    each record's commit holds, so no page change is left behind to be committed by mistake; the refusals
    still reach the user, on the command's exit."""
    from studies import cli

    order: list[str] = []

    def compare(*args, **kwargs):
        order.append("invocation page")
        return tmp_path / "walk3.md", ["grpo-N4 seed 14: not trained here"]

    monkeypatch.setattr(cli, "compare", compare)
    monkeypatch.setattr(cli, "commit_registration", lambda results: None)
    monkeypatch.setattr(cli, "rebuild_pages", lambda *a: lambda: order.append("records' pages") or [])
    with pytest.raises(SystemExit, match="seed 14: not trained here"):
        main(["compare", "walk3", "--commit", "--results", str(tmp_path)])
    assert order == ["invocation page", "records' pages"]
    order.clear()
    with pytest.raises(SystemExit):
        main(["compare", "walk3", "--results", str(tmp_path)])  # no --commit: the invocation's page stays
    assert order == ["invocation page"]
