"""`cell_sums`: a cell's per-batch sums under a disk budget equal those from all stored gradients, whatever
the budget, through stops and resumes, with or without a helper process in the second pass; a batch that
does not repeat stops the cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from studies.cell_sums import CellSums, batches_that_fit, row_sums, sum_names

LABELS = ["otb/early", "otb/late", "dr_grpo/early", "dr_grpo/late"]
ESTIMATORS = ("otb", "dr_grpo")
K, DIM = 10, 37


def _vectors(j: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + j)
    return {label: torch.randn(DIM, generator=g) * (1 + i) for i, label in enumerate(LABELS)}


class Batches:
    """A deterministic measurement (batch j from its own seed) that can stop after `stop_after` calls or
    give a different batch the second time it is asked for `drift`."""

    def __init__(self, stop_after: int | None = None, drift: int | None = None):
        self.calls, self.seen, self.stop_after, self.drift = 0, set(), stop_after, drift

    def __call__(self, j: int) -> tuple[dict[str, torch.Tensor], dict]:
        if self.stop_after is not None and self.calls >= self.stop_after:
            raise KeyboardInterrupt("stopped")
        self.calls += 1
        vectors = _vectors(j)
        if j == self.drift and j in self.seen:
            vectors = {k: v * 1.01 for k, v in vectors.items()}
        self.seen.add(j)
        return vectors, {"batch": j, "cpu_seconds": 0.1}


def _reference() -> dict[str, dict[str, list]]:
    stored = np.stack([np.stack([_vectors(j)[label].numpy() for label in LABELS]) for j in range(K)])
    return row_sums(stored.astype(np.float32), LABELS, ESTIMATORS)


def _work(folder, stored: int, every: int = 3) -> CellSums:
    header = {"protocol": "p", "k": K, "dim": DIM, "labels": LABELS, "weights": "w"}
    return CellSums(folder, header, stored, every=every)


def _close(got: dict, want: dict) -> None:
    assert list(got) == sum_names(ESTIMATORS) == list(want)
    for name in want:
        for key in ("d", "r"):
            np.testing.assert_allclose(got[name][key], want[name][key], rtol=1e-12, atol=0)


@pytest.mark.parametrize("stored", [0, 4, K])
def test_any_disk_budget_gives_the_sums_of_all_stored_gradients(tmp_path, stored) -> None:
    batches, sums, storage = _work(tmp_path / "cell", stored).run(Batches(), ESTIMATORS, log=lambda _: None)
    _close(sums, _reference())
    assert [b["batch"] for b in batches] == list(range(K))
    assert storage == {
        "stored_batches": stored,
        "recomputed_batches": K - stored,
        "recomputed_max_relative_difference": 0.0,
    }
    assert (tmp_path / "cell" / "grads.npy").is_file() == (stored > 0)
    assert all(("cpu_seconds_again" in b) == (b["batch"] >= stored) for b in batches)


@pytest.mark.parametrize(
    ("stop_after", "kept"),
    [(2, K), (7, 4), (13, 4), (15, 4)],  # before the first save (nothing kept), in pass 1, in pass 2
)
def test_a_stopped_cell_resumes_to_the_same_sums(tmp_path, stop_after, kept) -> None:
    folder = tmp_path / "cell"
    with pytest.raises(KeyboardInterrupt):
        _work(folder, stored=4).run(Batches(stop_after=stop_after), ESTIMATORS, log=lambda _: None)
    # a later run with another budget keeps the saved one (its stored gradients are part of the state);
    # stopped before the first save, nothing was kept and the new budget holds
    again = _work(folder, stored=K)
    measure = Batches()
    batches, sums, storage = again.run(measure, ESTIMATORS, log=lambda _: None)
    _close(sums, _reference())
    assert storage["stored_batches"] == kept and [b["batch"] for b in batches] == list(range(K))
    if kept == 4:
        assert measure.calls < K + (K - 4)  # it resumed: fewer batches than a fresh start measures


def test_a_changed_header_starts_over(tmp_path) -> None:
    folder = tmp_path / "cell"
    with pytest.raises(KeyboardInterrupt):
        _work(folder, stored=0).run(Batches(stop_after=8), ESTIMATORS, log=lambda _: None)
    other = CellSums(folder, {"protocol": "q", "k": K, "dim": DIM, "labels": LABELS, "weights": "w"}, 0)
    measure = Batches()
    _, sums, _ = other.run(measure, ESTIMATORS, log=lambda _: None)
    assert measure.calls == 2 * K
    _close(sums, _reference())


def test_a_batch_that_does_not_repeat_stops_the_cell(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="did not repeat the batch"):
        _work(tmp_path / "cell", stored=2).run(Batches(drift=6), ESTIMATORS, log=lambda _: None)
    # a stored batch is never measured again, so drifting there changes nothing
    _, sums, _ = _work(tmp_path / "other", stored=2).run(Batches(drift=1), ESTIMATORS, log=lambda _: None)
    _close(sums, _reference())


def test_a_state_without_its_stored_gradients_starts_over(tmp_path) -> None:
    folder = tmp_path / "cell"
    with pytest.raises(KeyboardInterrupt):
        _work(folder, stored=4).run(Batches(stop_after=7), ESTIMATORS, log=lambda _: None)
    (folder / "grads.npy").unlink()  # the state alone would read zeros for the stored batches
    measure = Batches()
    _, sums, _ = _work(folder, stored=4).run(measure, ESTIMATORS, log=lambda _: None)
    assert measure.calls == K + (K - 4)  # from the start
    _close(sums, _reference())


def test_a_recomputed_batch_whose_norm_is_nan_stops_the_cell(tmp_path) -> None:
    class NaNAgain(Batches):
        def __call__(self, j):
            vectors, info = super().__call__(j)
            if self.calls > K:  # the second pass
                vectors = {k: v * float("nan") for k, v in vectors.items()}
            return vectors, info

    with pytest.raises(RuntimeError, match="did not repeat"):
        _work(tmp_path / "cell", stored=0).run(NaNAgain(), ESTIMATORS, log=lambda _: None)


@pytest.mark.parametrize(
    ("main_stops_after", "helper_stops_after", "helped"),
    [
        (10, None, 6),  # main stopped as pass 2 began (saved n2 = 3): the helper does all 6 batches again
        (10, 2, 2),  # the helper stopped after 9 and 8: the main process measures 4-7 itself
        (13, None, 4),  # main saved n2 = 6 in pass 2: the helper stops there (9, 8, 7, 6)
    ],
)
def test_a_helper_shares_the_second_pass_and_the_sums_are_the_same(
    tmp_path, main_stops_after, helper_stops_after, helped
) -> None:
    folder = tmp_path / "cell"
    with pytest.raises(KeyboardInterrupt):
        _work(folder, stored=4).run(Batches(stop_after=main_stops_after), ESTIMATORS, log=lambda _: None)
    helper = Batches(stop_after=helper_stops_after)
    if helper_stops_after is None:
        assert _work(folder, stored=4).help(helper, ESTIMATORS, log=lambda _: None) == helped
    else:
        with pytest.raises(KeyboardInterrupt):
            _work(folder, stored=4).help(helper, ESTIMATORS, log=lambda _: None)
    assert helper.calls == helped
    main = Batches()
    batches, sums, storage = _work(folder, stored=4).run(main, ESTIMATORS, log=lambda _: None)
    _close(sums, _reference())
    assert storage["recomputed_by_helper"] == helped
    assert storage["recomputed_batches"] == K - 4 and storage["recomputed_max_relative_difference"] == 0.0
    assert sorted(b["batch"] for b in batches if b.get("measured_again_by_helper"))[-1] == K - 1
    assert all("cpu_seconds_again" in b for b in batches[4:])


def test_a_helper_needs_the_finished_first_pass_of_the_same_cell(tmp_path) -> None:
    folder = tmp_path / "cell"
    with pytest.raises(ValueError, match="no saved cell"):
        _work(folder, stored=4).help(Batches(), ESTIMATORS, log=lambda _: None)
    with pytest.raises(KeyboardInterrupt):
        _work(folder, stored=4).run(Batches(stop_after=7), ESTIMATORS, log=lambda _: None)
    with pytest.raises(ValueError, match="first pass has measured 6 of 10"):
        _work(folder, stored=4).help(Batches(), ESTIMATORS, log=lambda _: None)
    other = CellSums(folder, {"protocol": "q", "k": K, "dim": DIM, "labels": LABELS, "weights": "w"}, 4)
    with pytest.raises(ValueError, match="another header"):
        other.help(Batches(), ESTIMATORS, log=lambda _: None)
    assert (folder / "state.npz").is_file()  # a refused helper leaves the cell as it was


def test_a_helper_batch_that_does_not_repeat_stops_the_helper(tmp_path) -> None:
    folder = tmp_path / "cell"
    with pytest.raises(KeyboardInterrupt):
        _work(folder, stored=4).run(Batches(stop_after=10), ESTIMATORS, log=lambda _: None)

    class Other(Batches):
        def __call__(self, j):
            vectors, info = super().__call__(j)
            return {k: v * 1.01 for k, v in vectors.items()}, info

    with pytest.raises(RuntimeError, match="did not repeat the batch"):
        _work(folder, stored=4).help(Other(), ESTIMATORS, log=lambda _: None)


def test_batches_that_fit() -> None:
    per_batch = 4 * 532_352 * 4  # walk's cells: 4 rows of 532,352 float32
    assert batches_that_fit(15_280, 4, 532_352, 130.2) == 15_280  # all of walk-rl-N4
    assert batches_that_fit(15_280, 4, 532_352, 48.0) == int(48e9 // per_batch)
    assert batches_that_fit(10, 4, 532_352, 0.0) == 0
    assert batches_that_fit(10, 4, 532_352, -3.0) == 0
