"""The registered variance study of claim (a) (`studies.variance_a`): the position-bucket restriction
against a float64 reference, the per-batch sums every interval is rebuilt from, the power rule, the
verdict rule, and the protocol's registration refusing a change. The rebuild of the committed page from
the committed data alone is in test_variance_a_data.py."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from studies import variance_a, variance_a_cli
from studies.cell_sums import row_sums
from studies.gradstats import (
    Moments,
    RowSums,
    jackknife_log_interval,
    moments_nsr_ratio,
    nsr_ratio,
    sums_nsr,
    sums_nsr_ratio,
    sums_variance_ratio,
)
from studies.pages import write_record
from studies.variance import policy_gradients, position_buckets
from studies.variance_a import Cell, Study, power_plan, register_stage


class Unigram(torch.nn.Module):
    """log π(y) = log_softmax(θ)_y at every position: ∇θ log π(y) = e_y − softmax(θ), exactly."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.theta = torch.nn.Parameter(torch.randn(vocab, generator=torch.Generator().manual_seed(1)))


def test_position_buckets_count_policy_tokens_only() -> None:
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])  # row 0: a tool span
    b = position_buckets(mask, late_from=3)
    assert b["early"].tolist() == [[1, 1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    assert b["late"].tolist() == [[0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    assert torch.equal(b["early"] + b["late"], mask)
    with pytest.raises(ValueError, match="late_from"):
        position_buckets(mask, 0)


def test_bucket_gradients_match_a_float64_reference() -> None:
    vocab, rows, width, late_from = 5, 3, 6, 2
    gen = torch.Generator().manual_seed(0)
    model = Unigram(vocab)
    tokens = torch.randint(0, vocab, (rows, width), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    adv = torch.randn(rows, width, generator=gen) * mask
    logp = torch.log_softmax(model.theta, -1)[tokens] * mask
    buckets = position_buckets(mask, late_from)
    masked = {b: adv * m for b, m in buckets.items()} | {"all": adv}
    grads = policy_gradients(model, logp, masked)

    theta = model.theta.detach().double()
    pi = torch.softmax(theta, -1)
    for bucket in ("early", "late", "all"):
        want = torch.zeros(vocab, dtype=torch.float64)
        for i in range(rows):
            k = 0  # policy-token index along the response
            for t in range(width):
                if not mask[i, t]:
                    continue
                inside = bucket == "all" or (k < late_from) == (bucket == "early")
                if inside:
                    want += float(adv[i, t]) * (
                        torch.nn.functional.one_hot(tokens[i, t], vocab).double() - pi
                    )
                k += 1
        torch.testing.assert_close(grads[bucket].double(), want / rows, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads["early"] + grads["late"], grads["all"], rtol=1e-5, atol=1e-7)


def _gaussian(k: int, dim: int, scale: float, seed: int, mean: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return mean + scale * torch.randn(k, dim, generator=gen, dtype=torch.float64)


def test_row_sums_give_the_gram_moments_and_the_same_interval() -> None:
    mean = torch.linspace(0.5, 1.5, 40, dtype=torch.float64)
    a, b = _gaussian(30, 40, 2.0, 0, mean), _gaussian(30, 40, 3.0, 1, mean)
    ga, gb = a @ a.T, b @ b.T
    sa = RowSums.of_vectors(a)
    from_gram = RowSums.of_gram(ga)
    np.testing.assert_allclose(sa.d, from_gram.d, rtol=1e-12)
    np.testing.assert_allclose(sa.r, from_gram.r, rtol=1e-12)
    every = list(range(30))
    for idx in (every, every[:7] + every[8:]):
        want, got = Moments.of_gram(ga, idx), sa.moments(idx)
        assert got.k == want.k
        assert math.isclose(got.sq_norms, want.sq_norms, rel_tol=1e-12)
        assert math.isclose(got.sum_sq, want.sum_sq, rel_tol=1e-10)
    with pytest.raises(ValueError, match="all but one"):
        sa.moments(every[2:])
    want_iv, got_iv = nsr_ratio(ga, gb, every), sums_nsr_ratio(sa, RowSums.of_vectors(b))
    for x, y in zip(
        (want_iv.ratio, want_iv.lo, want_iv.hi), (got_iv.ratio, got_iv.lo, got_iv.hi), strict=True
    ):
        assert math.isclose(x, y, rel_tol=1e-9)


@pytest.mark.parametrize("signal", [1.0, 0.05, 0.0])
def test_vectorized_jackknife_equals_one_subset_at_a_time(signal: float) -> None:
    """The sums_* intervals take every leave-one-out in one pass (K is tens of thousands in variance-b);
    they must equal the generic jackknife over RowSums.moments bit for bit, and say undetermined
    where some K - 1 subset has no signal (signal 0: pure noise around a zero mean)."""
    k, dim = 25, 30
    mean = signal * torch.ones(dim, dtype=torch.float64)
    a, b = (
        RowSums.of_vectors(_gaussian(k, dim, 1.0, 5, mean)),
        RowSums.of_vectors(_gaussian(k, dim, 1.5, 6, mean)),
    )
    every = list(range(k))

    def nsr_of(rs: RowSums):
        return lambda s: rs.moments(s).nsr(debiased=True)

    def tc_ratio(s):
        return a.moments(s).trace_cov / b.moments(s).trace_cov

    pairs = [
        (sums_nsr_ratio(a, b), moments_nsr_ratio(a.moments, b.moments, every)),
        (sums_nsr(a), jackknife_log_interval(nsr_of(a), every)),
        (sums_variance_ratio(a, b), jackknife_log_interval(tc_ratio, every)),
    ]
    for got, want in pairs:
        assert got.k == want.k == k
        for x, y in (
            (got.ratio, want.ratio),
            (got.lo, want.lo),
            (got.hi, want.hi),
            (got.log_se, want.log_se),
        ):
            assert x == y or (math.isnan(x) and math.isnan(y)), (got, want)
    if signal == 1.0:
        assert all(math.isfinite(iv.lo) for iv, _ in pairs)
    if signal == 0.0:
        assert math.isnan(pairs[0][0].lo)  # no measurable signal somewhere: undetermined, not a number
    with pytest.raises(ValueError, match="same batches"):
        sums_nsr_ratio(a, RowSums(a.d[:-1], a.r[:-1]))


def test_row_sums_of_stored_buckets_add_up_to_all() -> None:
    k, dim = 6, 12
    gen = torch.Generator().manual_seed(3)
    labels = ["otb/early", "otb/late", "dr_grpo/early", "dr_grpo/late"]
    stored = torch.randn(k, len(labels), dim, generator=gen).numpy().astype(np.float32)
    out = row_sums(stored, labels, ("otb", "dr_grpo"))
    for est in ("otb", "dr_grpo"):
        for bucket in ("early", "late", "all"):
            if bucket == "all":
                vecs = sum(
                    torch.from_numpy(stored[:, labels.index(f"{est}/{b}")]).double()
                    for b in ("early", "late")
                )
            else:
                vecs = torch.from_numpy(stored[:, labels.index(f"{est}/{bucket}")]).double()
            want = RowSums.of_vectors(vecs)
            np.testing.assert_allclose(out[f"{est}/{bucket}"]["d"], want.d, rtol=1e-12)
            np.testing.assert_allclose(out[f"{est}/{bucket}"]["r"], want.r, rtol=1e-12)


def _fake_record(cell: Cell, k: int, noise_a: float, noise_b: float, seed: int) -> dict:
    """A record with the shape `run_cell` writes, from Gaussian gradients with known noise levels."""
    mean = torch.ones(50, dtype=torch.float64)
    sums = {}
    for est, scale, s in (("otb", noise_a, seed), ("dr_grpo", noise_b, seed + 1)):
        for j, bucket in enumerate(("early", "late", "all")):
            rs = RowSums.of_vectors(_gaussian(k, 50, scale, 10 * s + j, mean))
            sums[f"{est}/{bucket}"] = {"d": list(rs.d), "r": list(rs.r)}
    batches = [{"seed": j, "reward": 0.5, "length": 19.0, "cpu_seconds": 0.5} for j in range(k)]
    return {"estimators": ["otb", "dr_grpo"], "batches": batches, "sums": sums}


def _study(tmp_path: Path, edit=None) -> Study:
    raw = yaml.safe_load(variance_a.PROTOCOL.read_text())
    if edit:
        edit(raw)
    path = tmp_path / "variance-a.yaml"
    path.write_text(yaml.safe_dump(raw))
    return Study.load(path)


def test_power_rule_reaches_its_target_and_scales_to_the_budget(tmp_path) -> None:
    study = _study(tmp_path)
    pilot = {c: _fake_record(c, study.k("pilot", c), 6.0, 9.0, i) for i, c in enumerate(study.cells())}
    plan = power_plan(study, pilot)
    assert plan["scale"] == 1.0 or plan["needed_cpu_seconds"] > plan["budget_cpu_seconds"]
    for row in plan["cells"].values():
        assert row["k_needed"] >= row["pilot_k"]
        if plan["scale"] == 1.0:
            assert row["power"] >= plan["per_cell_target"] - 1e-9
    assert plan["k"] == {c.name: plan["cells"][c.name]["k"] for c in study.cells()}

    def tight(raw: dict) -> None:
        raw["pilot"]["power"]["budget_cpu_seconds"] = 60

    small = power_plan(_study(tmp_path, tight), pilot)
    assert small["scale"] < 1 and small["joint_power"] < plan["joint_power"] + 1e-12
    for name, row in small["cells"].items():
        assert row["k"] == max(row["pilot_k"], math.floor(plan["cells"][name]["k_needed"] * small["scale"]))
    with pytest.raises(ValueError, match="no record yet"):
        power_plan(study, dict(list(pilot.items())[:-1]))


def test_the_main_stage_needs_the_pilots_power_calculation_in_the_yaml(tmp_path) -> None:
    study = _study(tmp_path)
    data = tmp_path / "data"
    for i, c in enumerate(study.cells()):
        (data / "pilot").mkdir(parents=True, exist_ok=True)
        write_record(variance_a.record_path(data, "pilot", c), _fake_record(c, study.k("pilot", c), 6, 9, i))
    with pytest.raises(ValueError, match="power section"):
        variance_a.check_power(study, data)
    plan = power_plan(study, variance_a.load_records(study, data, "pilot"))

    def filled(raw: dict) -> None:
        raw["power"] = {"k": plan["k"]}

    variance_a.check_power(_study(tmp_path, filled), data)  # passes


def test_registration_refuses_a_changed_protocol(tmp_path) -> None:
    data = tmp_path / "data"
    study = _study(tmp_path)
    first = register_stage(study, data, "pilot", None)
    assert register_stage(study, data, "pilot", None) == first  # unchanged: accepted

    def power_filled(raw: dict) -> None:
        raw["power"] = {"k": {c.name: 100 for c in study.cells()}}

    assert (
        register_stage(_study(tmp_path, power_filled), data, "pilot", None) == first
    )  # the pilot's to decide

    def rule_changed(raw: dict) -> None:
        raw["pilot"]["power"]["planned_ratio"] = 0.7

    changed = _study(tmp_path, rule_changed)
    with pytest.raises(ValueError, match="variance-a --amend"):
        register_stage(changed, data, "pilot", None)
    assert register_stage(changed, data, "pilot", "a reason") != first
    reg = variance_a._registration(data / "pilot")
    assert reg["amendments"][0]["reason"] == "a reason" and reg["amendments"][0]["changed"] == ["pilot"]


def test_verdict_rule(tmp_path) -> None:
    study = _study(tmp_path)
    cells = study.cells()
    good = {c: _fake_record(c, 60, 0.5, 1.0, i) for i, c in enumerate(cells)}
    assert variance_a.decide(study, good)[0] == variance_a.HELD
    assert variance_a.decide(study, dict(list(good.items())[:-1]))[0] == variance_a.NOT_TESTED
    bad = copy.deepcopy(good)
    bad[cells[0]] = _fake_record(cells[0], 60, 1.0, 0.5, 99)
    assert variance_a.decide(study, bad)[0] == variance_a.NOT_HELD
    mixed = copy.deepcopy(good)
    mixed[cells[0]] = _fake_record(cells[0], 60, 0.7, 0.7, 7)
    assert variance_a.decide(study, mixed)[0] == variance_a.INCONCLUSIVE


def test_mechanism_claim_reads_committed_data(tmp_path) -> None:
    assert variance_a.mechanism_claim(tmp_path) is None  # nothing registered: no row
    study = Study.load()
    data = tmp_path / variance_a.NAME
    register_stage(study, data, "main", None)
    for i, c in enumerate(study.cells()):
        write_record(variance_a.record_path(data, "main", c), _fake_record(c, 60, 0.5, 1.0, i))
    claim = variance_a.mechanism_claim(tmp_path)
    assert claim.verdict == variance_a.HELD and claim.protocol in claim.measured
    assert claim.row()[2].startswith("**held** (rule: held if the 95% interval")
    shutil.rmtree(data)


def test_variance_b_reuses_variance_as_pilot_and_checkpoints_and_plans_the_rules_own_k(tmp_path) -> None:
    """variance-b re-measures claim (a) at the registered power rule's K, unscaled: its pilot records and
    trained checkpoints are variance-a's (`pilot_from`), its batches its own (another seed), its power
    section what the rule gives on variance-a's committed pilot, and it runs no pilot of its own."""
    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    a, b = (Study.load(variance_a.protocol_path(n)) for n in ("variance-a", "variance-b"))
    assert b.name == "variance-b" and b.home(results / "variance-b") == results / "variance-a"
    assert b.cells() == a.cells() and b.seed != a.seed
    assert {
        k: v for k, v in b.raw.items() if k not in ("seed", "pilot", "pilot_from", "power", "description")
    } == {k: v for k, v in a.raw.items() if k not in ("seed", "pilot", "power", "description")}
    cell = b.cells()[0]
    assert variance_a.batch_seed(a.seed, "main", cell, 0) != variance_a.batch_seed(b.seed, "main", cell, 0)
    pilot = variance_a.load_records(b, results / "variance-b", "pilot")
    assert len(pilot) == len(b.cells())  # read from variance-a's data
    plan = power_plan(b, pilot)
    assert plan["scale"] == 1.0 and plan["joint_power"] >= 0.8 and plan["k"] == b.power["k"]
    variance_a.check_power(b, results / "variance-b")
    args = type("Args", (), {"study": "variance-b", "quick": False, "results": tmp_path, "pilot": True})()
    with pytest.raises(ValueError, match="pilot_from"):
        variance_a_cli.main(args)
    with pytest.raises(ValueError, match="study"):
        variance_a.protocol_path("variance-z")
    assert (
        variance_a.study_command("variance-b", "--no-run")
        == "python -m studies variance-a --study variance-b --no-run"
    )
    assert variance_a.study_command("variance-a") == "python -m studies variance-a"


def test_an_unfinished_study_reads_not_tested_with_its_progress(tmp_path) -> None:
    study = Study.load(variance_a.protocol_path("variance-b"))
    data = tmp_path / "variance-b"
    register_stage(study, data, "main", None)
    for i, c in enumerate(study.cells()[:3]):
        write_record(variance_a.record_path(data, "main", c), _fake_record(c, 60, 0.5, 1.0, i))
    claim = variance_a.mechanism_claim(tmp_path, variance_a.protocol_path("variance-b"))
    assert claim.verdict == f"{variance_a.NOT_TESTED}, interim: 3 of 8 cells measured"
    cells = study.cells()
    write_record(variance_a.record_path(data, "main", cells[3]), _fake_record(cells[3], 60, 0.7, 0.7, 3))
    claim = variance_a.mechanism_claim(tmp_path, variance_a.protocol_path("variance-b"))
    name = f"{cells[3].task} {cells[3].checkpoint} N={cells[3].n}"
    assert claim.verdict.endswith(f"4 of 8 cells measured; held is out of reach ({name} not below 1)")
    assert "`variance-b`" in claim.measured and "--study variance-b" in claim.command


def test_a_helper_names_exactly_one_cell(tmp_path) -> None:
    from otbrl.app.cli import CliError
    from studies.cli import main

    for extra in ([], ["--cells", "walk-rl-N4,walk-rl-N8"]):
        with pytest.raises(CliError, match="exactly one cell"):
            main(["variance-a", "--study", "variance-b", "--helper", "--results", str(tmp_path), *extra])


def test_the_page_lists_cells_measured_in_two_passes() -> None:
    from studies.variance_a_page import _second_pass

    cells = Study.load(variance_a.protocol_path("variance-b")).cells()[:3]
    two_pass = {"stored_batches": 704, "recomputed_batches": 18700, "recomputed_max_relative_difference": 0.0}
    main = {
        cells[0]: {"storage": two_pass},
        cells[1]: {"storage": {**two_pass, "recomputed_batches": 0}},  # everything fit: not listed
        cells[2]: {},  # a record from before storage was recorded: not listed
    }
    text = "\n".join(_second_pass(main))
    assert f"| {cells[0].task} {cells[0].checkpoint} N={cells[0].n} | 704 | 18700 | 0 | 0.0e+00 |" in text
    assert text.count("\n| ") == 2  # the header and one row
    helped = {**two_pass, "recomputed_by_helper": 4000, "recomputed_max_relative_difference": 2e-9}
    assert "| 704 | 18700 | 4000 | 2.0e-09 |" in "\n".join(_second_pass({cells[0]: {"storage": helped}}))
    assert _second_pass({cells[2]: {}}) == []
