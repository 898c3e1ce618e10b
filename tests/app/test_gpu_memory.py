"""A GPU shared by several runs: each process's cap (OTBRL_GPU_MEMORY_FRACTION) and what launchers give."""

from __future__ import annotations

import pytest
import torch

from otbrl.app import gpu_memory
from otbrl.app.gpu_memory import ENV, apply_share, parse_fraction, peak_gib, share_env


@pytest.mark.parametrize("value", ["0", "-0.1", "1.5", "half", "nan", "inf"])
def test_a_fraction_outside_0_1_is_refused_with_the_variable_named(value):
    with pytest.raises(ValueError, match=ENV):
        parse_fraction(value)


def test_fractions_parse_and_unset_means_no_cap():
    assert parse_fraction("0.25") == 0.25 and parse_fraction("1") == 1.0
    assert parse_fraction(None) is None and parse_fraction("  ") is None


def test_a_bad_value_fails_on_a_machine_without_cuda_too(monkeypatch):
    """A typo in a launcher's environment shows on the CPU, not first on the GPU machine."""
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(ValueError, match=ENV):
        apply_share(log=lambda _: None)


def test_the_cap_is_applied_on_cuda(monkeypatch):
    calls, lines = [], []
    monkeypatch.setenv(ENV, "0.05")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f: calls.append(f))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: Props())
    assert apply_share(log=lines.append) == 0.05 and calls == [0.05]
    assert "4.0 of 80.0 GiB" in lines[0]
    monkeypatch.delenv(ENV)
    assert apply_share(log=lines.append) is None and calls == [0.05]


def test_launchers_split_the_shared_part_equally_and_respect_a_chosen_fraction():
    assert share_env(16, {}) == {ENV: "0.0562"} and share_env(4, {}) == {ENV: "0.2250"}
    assert float(share_env(16, {})[ENV]) * 16 <= gpu_memory.SHARED
    assert share_env(1, {}) == {} and share_env(8, {ENV: "0.2"}) == {}


def test_no_peak_without_cuda():
    if not torch.cuda.is_available():
        assert peak_gib() is None


def test_sized_shares_follow_each_runs_peak_and_cut_the_runs_at_once_to_what_fits():
    """walk's arms on an 80 GiB GPU: N=32 runs measured at 6 GiB and N=4 runs at 1.5 GiB get caps in that
    ratio (HEADROOM x peak), and 16 at once shrink to the most whose largest caps fit in SHARED."""
    from otbrl.app.gpu_memory import HEADROOM, SHARED, sized_shares

    peaks = [6.0, 1.5] * 8
    caps, fit = sized_shares(peaks, 16, 80.0)
    assert caps[:2] == [
        pytest.approx(HEADROOM * 6 / 80, abs=1e-4),
        pytest.approx(HEADROOM * 1.5 / 80, abs=1e-4),
    ]
    assert all(c * 80 >= HEADROOM * p for c, p in zip(caps, peaks, strict=True))  # rounded up, never down
    largest = sorted(caps, reverse=True)
    assert sum(largest[:fit]) <= SHARED < sum(largest[: fit + 1])  # the most that surely fit
    assert fit == 14  # all 8 N=32 runs (0.0938 each) and 6 N=4 runs (0.0234) fit in 0.9; 15 would not
    assert sized_shares([1.0] * 4, 16, 80.0)[1] == 4  # never more runs at once than runs
    assert sized_shares([], 4, 80.0) == ([], 4)
    with pytest.raises(ValueError, match="more than"):
        sized_shares([70.0], 2, 80.0)
