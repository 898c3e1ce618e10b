"""A variance cell's per-batch sums under a disk budget: d_k = ||g_k||^2 and r_k = g_k . sum_l g_l
(`gradstats.RowSums`), for every estimator in each position bucket and in all tokens.

r_k needs each batch's gradient twice: once for the total, then to dot with it. Keeping all K gradients
(float32, one row per estimator and bucket) costs K x rows x D x 4 bytes: 130 GB for walk's RL cell at
N=4 and 165 GB for running_sum16's, more than the disks of this project's machines hold. So the first
`stored` batches keep their gradients on disk and the others are measured again from their own seeds in a
second pass, which doubles their time but needs only the running total in memory. A batch measured again
must reproduce its first-pass norms; if it does not, the machine did not repeat it and the cell stops
(its sums would mix two different batches).

Both passes save their state every `every` batches, so a stopped cell resumes where it was on the same
machine (its scratch folder is not committed).

The second pass's batches are independent once the totals are known, so a second process on the same
machine (`CellSums.help`) may measure some of them again, from the last one down, while the main one goes
up; the main process takes those from the helper's file after the same check instead of measuring them.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

BUCKETS = ("early", "late")  # position buckets (`variance.position_buckets`); "all" is their sum
TOLERANCE = 1e-6  # relative: a batch measured again must give these norms (same machine: bit-equal)
HELPER = "helper.npz"  # a helper process's second-pass sums: batch j, d and r per sum, CPU seconds


def sum_names(estimators: tuple[str, ...]) -> list[str]:
    """The sums a record holds: every estimator in each bucket and in all tokens."""
    return [f"{e}/{b}" for e in estimators for b in (*BUCKETS, "all")]


def _named(stored: torch.Tensor, labels: list[str], estimators: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """(len(labels), D) float64 rows -> every `sum_names` vector ("all" = early + late)."""
    index = {label: i for i, label in enumerate(labels)}
    out = {f"{e}/{b}": stored[index[f"{e}/{b}"]] for e in estimators for b in BUCKETS}
    out.update({f"{e}/all": out[f"{e}/{BUCKETS[0]}"] + out[f"{e}/{BUCKETS[1]}"] for e in estimators})
    return out


def row_sums(grads: np.ndarray, labels: list[str], estimators: tuple[str, ...]) -> dict[str, dict[str, list]]:
    """The reference: the sums from all K stored gradients (K, len(labels), D) float32, in float64, two
    passes over them one batch at a time."""
    totals: dict[str, torch.Tensor] = {}
    for j in range(grads.shape[0]):
        for name, g in _named(torch.from_numpy(np.asarray(grads[j])).double(), labels, estimators).items():
            totals[name] = totals[name] + g if name in totals else g.clone()
    sums: dict[str, dict[str, list]] = {name: {"d": [], "r": []} for name in sum_names(estimators)}
    for j in range(grads.shape[0]):
        for name, g in _named(torch.from_numpy(np.asarray(grads[j])).double(), labels, estimators).items():
            sums[name]["d"].append(g.square().sum().item())
            sums[name]["r"].append((g @ totals[name]).item())
    return sums


def batches_that_fit(k: int, rows: int, dim: int, gigabytes: float) -> int:
    """How many of K batches' gradients (rows x D float32 each) fit in `gigabytes` of disk."""
    per_batch = rows * dim * 4
    return max(0, min(k, int(gigabytes * 1e9 // per_batch)))


Measure = Callable[[int], tuple[dict[str, torch.Tensor], dict[str, Any]]]


@dataclass
class CellSums:
    """One cell's unfinished work in `folder`: the batches' descriptions (progress.json), the running
    state (state.npz: the float64 totals, d and r so far) and the first `stored` batches' gradients
    (grads.npy, a float32 memory map). Resumed only under the same header (protocol, K, dimension, rows)."""

    folder: Path
    header: dict[str, Any]
    stored: int
    every: int = 25
    batches: list[dict[str, Any]] = field(default_factory=list)

    def run(
        self, measure: Measure, estimators: tuple[str, ...], log: Callable[[str], Any] = print, desc: str = ""
    ) -> tuple[list[dict[str, Any]], dict[str, dict[str, list]], dict[str, Any]]:
        """Both passes (resuming): returns the batches' descriptions, the sums (`sum_names` -> {"d", "r"}
        lists of K floats) and what the storage did (stored and recomputed batches, the largest relative
        difference of a recomputed batch's norms)."""
        from tqdm.auto import tqdm

        k, labels, dim = int(self.header["k"]), list(self.header["labels"]), int(self.header["dim"])
        names = sum_names(estimators)
        state = self._open(len(labels), dim, len(names))
        grads = self._grads(len(labels), dim)
        if state["n1"] == 0 or state["n2"] < k:
            log(
                f"{desc}: {self.stored} of {k} batches keep their gradients on disk "
                f"({self.stored * len(labels) * dim * 4 / 1e9:.1f} GB); {k - self.stored} are measured again"
            )
        totals = torch.from_numpy(state["totals"])  # shares memory: saved as it grows
        bar = tqdm(total=2 * k, initial=state["n1"] + state["n2"], desc=desc, dynamic_ncols=True)
        for j in range(state["n1"], k):
            vectors, info = measure(j)
            g = torch.stack([vectors[label].detach().float() for label in labels])
            if j < self.stored:
                grads[j] = g.numpy()
            g = g.double()
            totals += g
            vs = _named(g, labels, estimators)
            for i, name in enumerate(names):
                state["d"][i, j] = vs[name].square().sum().item()
            self.batches.append(info)
            state["n1"] = j + 1
            if state["n1"] % self.every == 0 or state["n1"] == k:
                self._save(state, grads)
            bar.update()
        named_totals = _named(totals, labels, estimators)
        helped = _Helped(self.folder / HELPER)
        for j in range(state["n2"], k):
            done = helped.get(j) if j >= self.stored else None
            if done is not None:  # a helper measured it again: the same check, its r as it computed it
                ds, rs, cpu = done
                for i, name in enumerate(names):
                    self._check_again(state, i, j, float(ds[i]), name, desc)
                    state["r"][i, j] = rs[i]
                self.batches[j].update(cpu_seconds_again=cpu, measured_again_by_helper=True)
            else:
                if j < self.stored:
                    g = torch.from_numpy(np.asarray(grads[j])).double()
                else:
                    vectors, info = measure(j)
                    g = torch.stack([vectors[label].detach().float() for label in labels]).double()
                    self.batches[j]["cpu_seconds_again"] = info.get("cpu_seconds")
                vs = _named(g, labels, estimators)
                for i, name in enumerate(names):
                    v = vs[name]
                    if j >= self.stored:
                        self._check_again(state, i, j, v.square().sum().item(), name, desc)
                    state["r"][i, j] = (v @ named_totals[name]).item()
            state["n2"] = j + 1
            if state["n2"] % self.every == 0 or state["n2"] == k:
                self._save(state, grads)
            bar.update()
        bar.close()
        sums = {
            name: {"d": state["d"][i].tolist(), "r": state["r"][i].tolist()} for i, name in enumerate(names)
        }
        storage = {
            "stored_batches": self.stored,
            "recomputed_batches": k - self.stored,
            "recomputed_max_relative_difference": float(state["max_diff"]),
        }
        by_helper = sum(1 for b in self.batches if b.get("measured_again_by_helper"))
        if by_helper:
            storage["recomputed_by_helper"] = by_helper
        return self.batches, sums, storage

    def help(
        self, measure: Measure, estimators: tuple[str, ...], log: Callable[[str], Any] = print, desc: str = ""
    ) -> int:
        """A second process's share of the second pass, beside the main process's `run` on the same folder
        (same machine, same header, so the same threads): the batches measured again, from the last one
        down, each checked against its first-pass norms, their sums saved to helper.npz after each one
        (the main process takes them from there). It needs the first pass finished (saved), stops
        where the main process's saved second pass has come to, and resumes its own file. Returns how many
        batches it measured."""
        from tqdm.auto import tqdm

        k, labels = int(self.header["k"]), list(self.header["labels"])
        names = sum_names(estimators)
        state = self._saved()
        if state["n1"] < k:
            raise ValueError(
                f"{desc}: the first pass has measured {state['n1']} of {k} batches; start the helper once "
                "the main process has finished it"
            )
        totals = _named(torch.from_numpy(state["totals"]), labels, estimators)
        kept = _Helped(self.folder / HELPER).load()
        js = sorted(kept, reverse=True)
        d = [list(kept[j][0]) for j in js]
        r = [list(kept[j][1]) for j in js]
        cpu = [kept[j][2] for j in js]
        lowest = min(js) if js else k
        measured = 0
        bar = tqdm(total=max(0, lowest - self.stored), desc=desc, dynamic_ncols=True)
        for j in range(lowest - 1, self.stored - 1, -1):
            if j < self._main_n2():
                break  # the main process is past it
            vectors, info = measure(j)
            g = torch.stack([vectors[label].detach().float() for label in labels]).double()
            vs = _named(g, labels, estimators)
            ds = [vs[name].square().sum().item() for name in names]
            for i, name in enumerate(names):
                self._check_again(state, i, j, ds[i], name, desc)
            js.append(j)
            d.append(ds)
            r.append([(vs[name] @ totals[name]).item() for name in names])
            cpu.append(float(info.get("cpu_seconds", math.nan)))
            measured += 1
            self._save_helped(js, d, r, cpu)  # every batch: the main process may need it next
            bar.update()
        bar.close()
        log(f"{desc}: measured {measured} batches again ({len(js)} in {self.folder / HELPER})")
        return measured

    def _check_again(self, state: dict[str, Any], i: int, j: int, got: float, name: str, desc: str) -> None:
        """A batch measured again must give its first-pass norm (else the cell stops: see the module)."""
        want = state["d"][i, j]
        diff = abs(got - want) / max(abs(want), 1e-300)
        state["max_diff"] = max(float(state["max_diff"]), diff)
        if not diff <= TOLERANCE:  # NaN included
            raise RuntimeError(
                f"{desc}: batch {j} measured again gives ||g||^2 = {got!r} for {name}, against "
                f"{want!r} the first time (relative difference {diff:.2e} > {TOLERANCE:g}): this "
                "machine did not repeat the batch, so its sums cannot be completed here; delete "
                f"{self.folder} to measure the cell again from the start"
            )

    # ------------------------------------------------------------------------------------------------
    @property
    def progress(self) -> Path:
        return self.folder / "progress.json"

    def _open(self, rows: int, dim: int, names: int) -> dict[str, Any]:
        """The saved state when its header matches (its `stored` wins over this run's), else a fresh one."""
        self.folder.mkdir(parents=True, exist_ok=True)
        state_file = self.folder / "state.npz"
        if self.progress.is_file() and state_file.is_file():
            saved = json.loads(self.progress.read_text())
            grads_kept = int(saved["stored"]) == 0 or (self.folder / "grads.npy").is_file()
            if saved["header"] == self.header and grads_kept:
                with np.load(state_file) as z:
                    state = {key: z[key].copy() for key in z.files}
                state["n1"], state["n2"] = int(state["n1"]), int(state["n2"])
                self.stored = int(saved["stored"])
                self.batches = saved["batches"][: state["n1"]]  # progress is written first: never fewer
                return state
        for f in ("grads.npy", "state.npz", "progress.json", HELPER):
            (self.folder / f).unlink(missing_ok=True)
        k = int(self.header["k"])
        self.batches = []
        return {
            "totals": np.zeros((rows, dim), dtype=np.float64),
            "d": np.full((names, k), math.nan),
            "r": np.full((names, k), math.nan),
            "n1": 0,
            "n2": 0,
            "max_diff": np.float64(0.0),
        }

    def _saved(self) -> dict[str, Any]:
        """The main process's saved state, read only (a helper never starts or resets a cell)."""
        state_file = self.folder / "state.npz"
        if not (self.progress.is_file() and state_file.is_file()):
            raise ValueError(f"{self.folder}: no saved cell to help (start the main process first)")
        saved = json.loads(self.progress.read_text())
        if saved["header"] != self.header:
            raise ValueError(f"{self.folder}: the saved cell was measured under another header: not helping")
        self.stored = int(saved["stored"])
        with np.load(state_file) as z:
            state = {key: z[key].copy() for key in z.files}
        state["n1"], state["n2"] = int(state["n1"]), int(state["n2"])
        return state

    def _main_n2(self) -> int:
        with np.load(self.folder / "state.npz") as z:
            return int(z["n2"])

    def _save_helped(self, js: list[int], d: list, r: list, cpu: list[float]) -> None:
        tmp = self.folder / "helper.tmp.npz"
        np.savez(
            tmp,
            j=np.asarray(js, dtype=np.int64),
            d=np.asarray(d, dtype=np.float64).reshape(len(js), -1).T,
            r=np.asarray(r, dtype=np.float64).reshape(len(js), -1).T,
            cpu=np.asarray(cpu, dtype=np.float64),
        )
        tmp.replace(self.folder / HELPER)

    def _grads(self, rows: int, dim: int) -> np.ndarray | None:
        if self.stored == 0:
            return None
        path = self.folder / "grads.npy"
        shape = (self.stored, rows, dim)
        if path.is_file():
            return np.lib.format.open_memmap(path, mode="r+")
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=shape)

    def _save(self, state: dict[str, Any], grads: np.ndarray | None) -> None:
        """Gradients first, then the descriptions, then the state (each written whole, then renamed): a
        stop between two writes leaves a state that covers no batch it has not seen."""
        if grads is not None:
            grads.flush()
        tmp = self.progress.with_suffix(".tmp")
        tmp.write_text(json.dumps({"header": self.header, "stored": self.stored, "batches": self.batches}))
        tmp.replace(self.progress)
        tmp = self.folder / "state.tmp.npz"
        np.savez(tmp, **state)
        tmp.replace(self.folder / "state.npz")

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


class _Helped:
    """A helper's second-pass sums (helper.npz), read again whenever the file changes."""

    def __init__(self, path: Path):
        self.path, self.stamp, self.done = path, None, {}

    def load(self) -> dict[int, tuple[np.ndarray, np.ndarray, float]]:
        """Batch j -> (d per sum, r per sum, CPU seconds)."""
        if not self.path.is_file():
            return {}
        with np.load(self.path) as z:
            js, d, r, cpu = z["j"], z["d"], z["r"], z["cpu"]
        return {int(j): (d[:, n], r[:, n], float(cpu[n])) for n, j in enumerate(js)}

    def get(self, j: int) -> tuple[np.ndarray, np.ndarray, float] | None:
        try:
            stamp = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return None
        if stamp != self.stamp:
            self.stamp, self.done = stamp, self.load()
        return self.done.get(j)
