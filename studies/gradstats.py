"""Statistics of policy-gradient estimates, shared by the variance study and the toy testbed: variance
(trace of the covariance), noise-to-signal, MSE and cosine against a reference gradient, delete-one
jackknife errors and intervals, bias z-scores, and the correlations of the proxy energy with exact score
norms."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Moments:
    """What every statistic of K gradient estimates g_k against a reference g_ref is a function of:
    K, sum_k ||g_k||^2, ||sum_k g_k||^2, sum_k g_k . g_ref and ||g_ref||^2. Built from the vectors, or
    from their Gram matrix, where any subset of the K (jackknife leave-one-outs) costs nothing more."""

    k: int
    sq_norms: float
    sum_sq: float
    ref_dots: float = math.nan
    ref_sq: float = math.nan

    @classmethod
    def of_vectors(cls, grads: torch.Tensor, ref: torch.Tensor | None = None) -> Moments:
        """grads (K, D), ref (D,)."""
        g = grads.double()
        extra = {}
        if ref is not None:
            r = ref.double()
            extra = {"ref_dots": (g @ r).sum().item(), "ref_sq": r.square().sum().item()}
        return cls(len(g), g.square().sum().item(), g.sum(0).square().sum().item(), **extra)

    @classmethod
    def of_gram(
        cls, gram: torch.Tensor, idx: list[int], dots: torch.Tensor | None = None, ref_sq: float = math.nan
    ) -> Moments:
        """gram (K, K) of g_k . g_l, dots (K,) of g_k . g_ref; only the estimates idx."""
        sub = gram[idx][:, idx]
        ref_dots = dots[idx].sum().item() if dots is not None else math.nan
        return cls(len(idx), sub.diagonal().sum().item(), sub.sum().item(), ref_dots, ref_sq)

    @property
    def trace_cov(self) -> float:
        """Unbiased trace of Cov(g_k): (sum ||g_k||^2 - ||sum g_k||^2 / K) / (K - 1)."""
        return (self.sq_norms - self.sum_sq / self.k) / (self.k - 1)

    @property
    def mean_sq(self) -> float:
        """||mean_k g_k||^2."""
        return self.sum_sq / self.k**2

    @property
    def rel_mse(self) -> float:
        """mean_k ||g_k - g_ref||^2 / ||g_ref||^2."""
        return (self.sq_norms - 2 * self.ref_dots + self.k * self.ref_sq) / self.k / self.ref_sq

    @property
    def cosine(self) -> float:
        """cos(mean_k g_k, g_ref)."""
        return self.ref_dots / self.k / math.sqrt(self.mean_sq * self.ref_sq)

    def nsr(self, debiased: bool = True) -> float:
        """Noise-to-signal trace Cov / ||E g||^2 (scale-free). debiased: ||E g||^2 estimated without bias
        as ||mean g||^2 - trace Cov / K (matters at small K); otherwise ||mean g||^2. inf without signal."""
        signal = self.mean_sq - (self.trace_cov / self.k if debiased else 0.0)
        return self.trace_cov / signal if signal > 0 else math.inf


@dataclass(frozen=True)
class RowSums:
    """Per-batch sufficient statistics of K gradient estimates g_k: d_k = ||g_k||^2 and r_k = g_k . sum_l g_l
    (a row sum of their Gram matrix). They give the Moments of all K estimates and of every K - 1 (what a
    delete-one jackknife needs) in 2K numbers instead of K^2, so a study can commit them per batch and its
    intervals be recomputed from the committed data alone."""

    d: tuple[float, ...]
    r: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.d) != len(self.r):
            raise ValueError(f"d and r: one value per batch each, got {len(self.d)} and {len(self.r)}")

    @classmethod
    def of_vectors(cls, grads: torch.Tensor) -> RowSums:
        """grads (K, D), any float dtype: the sums are taken in float64."""
        g = grads.double()
        return cls(tuple(g.square().sum(-1).tolist()), tuple((g @ g.sum(0)).tolist()))

    @classmethod
    def of_gram(cls, gram: torch.Tensor) -> RowSums:
        return cls(tuple(gram.diagonal().tolist()), tuple(gram.sum(-1).tolist()))

    def moments(self, idx: list[int]) -> Moments:
        """Moments of the estimates idx: all K of them, or all but one (anything else needs the Gram)."""
        k = len(self.d)
        left = sorted(set(range(k)) - set(idx))
        if len(idx) != len(set(idx)) or len(idx) + len(left) != k or len(left) > 1:
            raise ValueError("idx: row sums give the moments of all K batches or of all but one only")
        sq, total = math.fsum(self.d), math.fsum(self.r)  # total = ||sum_l g_l||^2
        if left:  # ||S - g_j||^2 = ||S||^2 - 2 g_j . S + ||g_j||^2
            j = left[0]
            sq, total = sq - self.d[j], total - 2 * self.r[j] + self.d[j]
        return Moments(len(idx), sq, total)

    def loo_moments(self) -> Moments:
        """The K leave-one-out Moments at once: fields are (K,) float64 tensors (k is K - 1), each entry
        equal to `moments` without that batch (the same operations, elementwise). The jackknife on
        tens of thousands of batches needs this: one subset at a time costs O(K^2)."""
        d, r = torch.tensor(self.d, dtype=torch.float64), torch.tensor(self.r, dtype=torch.float64)
        sq, total = math.fsum(self.d), math.fsum(self.r)
        return Moments(len(self.d) - 1, sq - d, total - 2 * r + d)  # type: ignore[arg-type]

    def nsr_all_and_loo(self) -> tuple[float, torch.Tensor]:
        """Debiased NSR of all K batches, and (K,) of every K - 1 (inf where a subset has no signal)."""
        loo = self.loo_moments()
        tc = loo.trace_cov
        signal = loo.mean_sq - tc / loo.k
        return self.moments(list(range(len(self.d)))).nsr(debiased=True), torch.where(
            signal > 0, tc / signal, math.inf
        )


def trace_cov(gram: torch.Tensor, idx: list[int]) -> float:
    """Unbiased trace of the covariance of the gradients idx, from their Gram matrix."""
    return Moments.of_gram(gram, idx).trace_cov


def jackknife_se(stat: Callable[[list[int]], float], idx: list[int]) -> float:
    """Delete-one jackknife standard error of stat over the batches idx (NaN below 3 batches)."""
    k = len(idx)
    if k < 3:
        return math.nan
    loo = torch.tensor([stat(idx[:j] + idx[j + 1 :]) for j in range(k)], dtype=torch.float64)
    return math.sqrt((k - 1) / k * (loo - loo.mean()).square().sum().item())


def gradient_stats(gram: torch.Tensor, dots: torch.Tensor, ref_sq: float, idx: list[int]) -> dict[str, float]:
    """Relative variance (with jackknife SE), relative MSE, debiased noise-to-signal (with a 95% jackknife
    interval, see jackknife_log_interval) and cosine of the gradients idx, given their Gram matrix (K, K),
    their dot products with g_ref (K,) and ||g_ref||^2."""
    m = Moments.of_gram(gram, idx, dots, ref_sq)
    noise = jackknife_log_interval(lambda s: nsr(gram, s), idx)
    return {
        "rel_var": m.trace_cov / ref_sq,
        "rel_var_se": jackknife_se(lambda s: trace_cov(gram, s), idx) / ref_sq,
        "rel_mse": m.rel_mse,
        "nsr": m.nsr(debiased=True),
        "nsr_lo": noise.lo,
        "nsr_hi": noise.hi,
        "cosine": m.cosine,
        "k": m.k,
    }


def variance_ratio(gram_a: torch.Tensor, gram_b: torch.Tensor, idx: list[int]) -> tuple[float, float]:
    """trace Cov(a) / trace Cov(b) on the same batches idx, and its jackknife SE (paired: the batch-to-batch
    luck that the two share cancels)."""

    def ratio(s: list[int]) -> float:
        return trace_cov(gram_a, s) / trace_cov(gram_b, s)

    return ratio(idx), jackknife_se(ratio, idx)


def nsr(gram: torch.Tensor, idx: list[int]) -> float:
    """Debiased noise-to-signal trace Cov / ||E g||^2 of the gradients idx, from their Gram matrix."""
    return Moments.of_gram(gram, idx).nsr(debiased=True)


@dataclass(frozen=True)
class RatioInterval:
    """A paired ratio of two statistics on the same K batches with a 95% interval: `ratio` is the plug-in
    estimate on all K; lo, hi = exp(log ratio -/+ t_{0.975, K-1} * jackknife SE of the log ratio). NaN
    bounds mean the interval is undetermined (a leave-one-out subset had no measurable signal)."""

    ratio: float
    lo: float
    hi: float
    k: int
    log_se: float


def _log_positive(x: float) -> float:
    return math.log(x) if 0 < x < math.inf else math.nan


def jackknife_log_interval(
    stat: Callable[[list[int]], float], idx: list[int], level: float = 0.95
) -> RatioInterval:
    """Interval for a positive statistic (a ratio) over the batches idx: delete-one jackknife SE of its log,
    with a Student t quantile at K - 1 degrees of freedom (K is small: 16-24 batches). The log makes a
    ratio's interval symmetric in a / b versus b / a and keeps it positive."""
    k = len(idx)
    if k < 3:
        return RatioInterval(stat(idx), math.nan, math.nan, k, math.nan)
    return log_interval(stat(idx), [stat(idx[:j] + idx[j + 1 :]) for j in range(k)], level)


def log_interval(est: float, loo: list[float], level: float = 0.95) -> RatioInterval:
    """`jackknife_log_interval` given the statistic on all K batches and its K leave-one-out values (fewer
    than 3 leave undetermined bounds): for callers that get the leave-one-outs in one vectorized pass."""
    from scipy.stats import t as student_t  # heavy and optional: imported when an interval is made

    k = len(loo)
    logs = [_log_positive(x) for x in loo] if k >= 3 else []
    if not logs or any(math.isnan(x) for x in logs) or math.isnan(_log_positive(est)):
        return RatioInterval(est, math.nan, math.nan, k, math.nan)
    mean = sum(logs) / k
    se = math.sqrt((k - 1) / k * sum((x - mean) ** 2 for x in logs))
    half = float(student_t.ppf(0.5 + level / 2, k - 1)) * se
    return RatioInterval(est, est * math.exp(-half), est * math.exp(half), k, se)


def nsr_ratio(gram_a: torch.Tensor, gram_b: torch.Tensor, idx: list[int]) -> RatioInterval:
    """NSR(a) / NSR(b) on the same batches idx with its 95% jackknife interval. Unlike the variance ratio it
    is scale-free: a baseline that shrinks every advantage (a self-inclusive mean) lowers the variance
    and the signal alike and does not move it."""
    return moments_nsr_ratio(lambda s: Moments.of_gram(gram_a, s), lambda s: Moments.of_gram(gram_b, s), idx)


Subset = Callable[[list[int]], Moments]  # the moments of the estimates idx (a Gram matrix, or RowSums)


def moments_nsr_ratio(a: Subset, b: Subset, idx: list[int], level: float = 0.95) -> RatioInterval:
    """`nsr_ratio` for estimates given by their moments on any subset the jackknife asks for (from a Gram
    matrix, or from `RowSums.moments` when only per-batch sums were kept)."""

    def ratio(s: list[int]) -> float:
        nb = b(s).nsr(debiased=True)
        return a(s).nsr(debiased=True) / nb if nb > 0 else math.inf  # inf: undetermined (see below)

    return jackknife_log_interval(ratio, idx, level)


def sums_nsr_ratio(a: RowSums, b: RowSums, level: float = 0.95) -> RatioInterval:
    """NSR(a) / NSR(b) on the same K batches, from their per-batch sums, with its jackknife interval."""
    _same_batches(a, b)
    (na_all, na), (nb_all, nb) = a.nsr_all_and_loo(), b.nsr_all_and_loo()
    ratio = torch.where(nb > 0, na / nb, math.inf)  # inf: undetermined, as in moments_nsr_ratio
    return log_interval(na_all / nb_all if nb_all > 0 else math.inf, ratio.tolist(), level)


def sums_nsr(a: RowSums, level: float = 0.95) -> RatioInterval:
    """One estimator's debiased NSR on its K batches with its jackknife interval (log scale)."""
    est, loo = a.nsr_all_and_loo()
    return log_interval(est, loo.tolist(), level)


def sums_variance_ratio(a: RowSums, b: RowSums, level: float = 0.95) -> RatioInterval:
    """trace Cov(a) / trace Cov(b) on the same K batches (not scale-free: see `nsr_ratio`)."""
    _same_batches(a, b)
    ta, tb = a.loo_moments().trace_cov, b.loo_moments().trace_cov
    est = a.moments(list(range(len(a.d)))).trace_cov / b.moments(list(range(len(b.d)))).trace_cov
    return log_interval(est, (ta / tb).tolist(), level)


def _same_batches(a: RowSums, b: RowSums) -> None:
    if len(a.d) != len(b.d):
        raise ValueError(f"a and b: the same batches, got {len(a.d)} and {len(b.d)}")


def bias_z(grads: torch.Tensor, truth: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """z-scores (J,) of the mean of K estimates grads (K, D) minus the true gradient (D,), projected on
    each unit direction (J, D): for an unbiased estimator each is about standard normal."""
    proj = grads @ directions.T
    return (proj.mean(0) - directions @ truth) / (proj.var(0) / len(grads)).sqrt()


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return (x @ y / (x.norm() * y.norm())).item()


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Rank correlation (ties broken by order: the energies are continuous)."""
    return pearson(x.argsort().argsort(), y.argsort().argsort())


def correlations(
    proxy: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor
) -> dict[str, tuple[float, float, float, int]]:
    """Proxy vs exact energies (B, T), policy tokens mask (B, T), group ids (B,): (Pearson, Pearson of the
    logs, Spearman, count) per policy token; per sequence for W_T (sum over the sequence); and for W_T
    relative to its group's mean (OTB's baseline only compares energies within a group). The norms span
    orders of magnitude, so the linear Pearson is dominated by the largest few; the log and rank versions
    describe the bulk."""

    def stats(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, int]:
        tiny = 1e-30  # a zero energy (mask edge cases) must not give log(0)
        return (
            pearson(x, y),
            pearson(x.clamp_min(tiny).log(), y.clamp_min(tiny).log()),
            spearman(x, y),
            len(x),
        )

    keep = mask.bool()
    w_seq, e_seq = proxy.double().sum(-1), exact.sum(-1)

    def within(x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(int(groups.max()) + 1, dtype=x.dtype).index_add_(0, groups, x)
        count = torch.bincount(groups).to(x.dtype)
        return x / (total / count)[groups]

    return {
        "token": stats(proxy[keep], exact[keep]),
        "sequence": stats(w_seq, e_seq),
        "within_group": stats(within(w_seq), within(e_seq)),
    }


def pooled_correlations(tokens: dict[str, list]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Proxy-vs-exact `correlations` and the scatter points (token and sequence level) over batches of
    different widths: tokens holds lists of (B_i, T_i) "proxy", "exact", "mask" and (B_i,) "groups"."""
    if not tokens["mask"]:
        return {}, {}
    width = max(m.shape[1] for m in tokens["mask"])

    def cat(key: str) -> torch.Tensor:  # rows of different widths: pad with zeros (mask 0)
        return torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in tokens[key]])

    proxy, exact, mask = cat("proxy").double(), cat("exact"), cat("mask")
    keep = mask.bool()
    scatter = {"token": (proxy[keep], exact[keep]), "sequence": (proxy.sum(-1), exact.sum(-1))}
    return correlations(proxy, exact, mask, torch.cat(tokens["groups"])), scatter
