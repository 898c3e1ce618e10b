"""Training stability, forward-only: per-batch energy and advantage diagnostics (with the exact
logit-space squared norm of each trajectory's update), a gradient-norm surge detector, and a
learning-rate decay triggered by a surge in mean response length, for any torch training loop.

A sharp rise in mean response length is an early warning of RL collapse, and a smaller update size
suppresses the gradient noise behind it (arXiv 2602.01826), so `LengthSurgeDecay` watches the length and
cuts the learning rate when it surges; `scale_learning_rate` applies that cut so an LR scheduler keeps it.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any

import torch

from otbrl.inputs import check_mask, check_token_values

logger = logging.getLogger(__name__)

# MAD times this estimates the standard deviation of normal noise.
_MAD_TO_STD = 1.4826


def update_energy(advantages: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logit-space squared norm of each trajectory's update, sum_t A_t^2 w_t m_t.

    The update of token t moves its logits by A_t (e_y - pi_t); tokens own disjoint logit vectors, so
    the squared norm has no cross terms. advantages, energy, mask: (B, T). Returns (B,) float64.
    Unlike a parameter-space gradient norm, this is in the same units as the energy itself.
    """
    keep = check_mask(mask)
    a = check_token_values("advantages", advantages, keep)
    w = check_token_values("energy", energy, keep, nonnegative=True)
    return (a.square() * w).sum(dim=-1)


def batch_diagnostics(advantages: torch.Tensor, energy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Scalars to log once per batch (all over policy tokens, or over non-empty trajectories).

    energy/mean: mean per-token energy w_t.  energy/traj_mean: mean realized energy W_T per trajectory.
    adv/mean, adv/mean_sq, adv/abs_max: advantage statistics.
    update_energy/mean, update_energy/max: sum_t A_t^2 w_t per trajectory (see `update_energy`).
    """
    keep = check_mask(mask)
    a = check_token_values("advantages", advantages, keep)
    w = check_token_values("energy", energy, keep, nonnegative=True)
    tokens = keep.sum().item()
    rows = keep.any(dim=-1)
    n_rows = rows.sum().item()
    per_row = (a.square() * w).sum(dim=-1)[rows]

    def mean(total: torch.Tensor, count: float) -> float:
        return total.item() / count if count else 0.0

    return {
        "energy/mean": mean(w.sum(), tokens),
        "energy/traj_mean": mean(w.sum(dim=-1)[rows].sum(), n_rows),
        "adv/mean": mean(a.sum(), tokens),
        "adv/mean_sq": mean(a.square().sum(), tokens),
        "adv/abs_max": a.abs().max().item() if tokens else 0.0,
        "update_energy/mean": mean(per_row.sum(), n_rows),
        "update_energy/max": per_row.max().item() if n_rows else 0.0,
    }


def group_horizons(
    mask: torch.Tensor, energy: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor
) -> dict[str, float]:
    """How much trajectories differ inside their groups, the setting OTB's per-token weights act in.

    mask, energy: (B, T); rewards, group_ids: (B,). Rows without a policy token are left out; only
    groups with >= 2 rows count. Returns horizon/length_cv and horizon/energy_cv (within-group std / mean
    of the response length and of the realized energy W_T, population std, averaged over groups) and
    horizon/reward_spread (the share of groups whose rewards are not all equal: the others carry no
    signal), and horizon/energy_reward_corr (Pearson correlation of W_T and reward inside a group,
    averaged over the groups where both vary). Zeros when no group has two rows.
    """
    keep = mask.bool()
    rows = keep.any(dim=-1)
    lengths = keep.sum(dim=-1).double()[rows]
    totals = (energy.double() * keep).sum(dim=-1)[rows]
    r, g = rewards.double()[rows], group_ids[rows]
    length_cv, energy_cv, spread, corr = [], [], [], []
    for gid in torch.unique(g):
        members = g == gid
        if members.sum() < 2:
            continue
        for values, out in ((lengths[members], length_cv), (totals[members], energy_cv)):
            mean = values.mean()
            out.append((values.std(unbiased=False) / mean).item() if mean > 0 else 0.0)
        spread.append(float(r[members].max() > r[members].min()))
        e, y = totals[members] - totals[members].mean(), r[members] - r[members].mean()
        if e.norm() > 0 and y.norm() > 0:
            corr.append((e @ y / (e.norm() * y.norm())).item())
    avg = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    return {
        "horizon/length_cv": avg(length_cv),
        "horizon/energy_cv": avg(energy_cv),
        "horizon/reward_spread": avg(spread),
        "horizon/energy_reward_corr": avg(corr),
    }


class SurgeDetector:
    """Flags a step whose gradient norm exceeds `factor` times the median of the last `window` norms.

    Call `update(norm)` once per optimiser step; it returns True on a surge. Nothing fires during the
    first `warmup` steps. Surging values enter the history too, so a lasting new level stops firing
    after about window / 2 steps. A non-finite norm is always a surge. A zero norm (no group had a reward
    spread: nothing to learn from) is neither history nor a surge: counted in, it would drag the median
    to 0 and make the next ordinary step a "surge". `state_dict` / `load_state_dict` carry the history
    through checkpoints.
    """

    def __init__(self, factor: float = 3.0, window: int = 50, warmup: int = 10) -> None:
        if not (factor > 1):
            raise ValueError(f"factor: must be > 1, got {factor!r}")
        if window < 1 or warmup < 1:
            raise ValueError(f"window and warmup: must be >= 1, got window={window!r}, warmup={warmup!r}")
        self.factor, self.window, self.warmup = float(factor), int(window), int(warmup)
        self.history: deque[float] = deque(maxlen=self.window)
        self.steps = 0
        self.surges: list[int] = []  # step numbers (0-based) that fired

    def update(self, norm: float | torch.Tensor) -> bool:
        value = float(norm)
        if value == 0.0:
            self.steps += 1
            return False
        surge = not math.isfinite(value)
        if not surge and self.steps >= self.warmup and self.history:
            surge = value > self.factor * statistics.median(self.history)
        if math.isfinite(value):
            self.history.append(value)
        if surge:
            self.surges.append(self.steps)
        self.steps += 1
        return surge

    def state_dict(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "window": self.window,
            "warmup": self.warmup,
            "history": list(self.history),
            "steps": self.steps,
            "surges": list(self.surges),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(state["factor"], state["window"], state["warmup"])
        self.history.extend(state["history"])
        self.steps, self.surges = int(state["steps"]), list(state["surges"])


class LengthSurgeDecay:
    """A learning-rate multiplier that drops by `factor` each time the mean response length surges.

    Call `step(mean_length)` once per training step (or logging step); it returns the current multiplier.

    Detector. The length is smoothed by an exponential moving average, ema += smoothing * (x - ema). Its
    baseline is the raw lengths of the last `window` steps before the current one: their median, and
    their noise level sigma = 1.4826 * MAD(x_t - x_{t-1}) / sqrt(2), a robust standard deviation taken
    from step-to-step differences so that the surge itself (a trend or a level shift) barely inflates it.
    A step is *high* when
        ema > threshold * median             (a rise large in relative terms),
        ema > median + zscore * sigma        (large against the series' own step-to-step noise),
    and the step's own length > threshold * median. The first rule keeps a very steady series from firing
    on a trivial rise, the second keeps a noisy one from firing on its noise, the third keeps one outlier,
    which holds the EMA up for several steps, from firing alone. The detector fires after `patience`
    consecutive high steps, once it has seen `warmup` lengths. High lengths enter the history too, so a
    lasting new level stops firing after about window / 2 steps; a surge that goes on fires again after
    the cooldown.

    Decay. On firing, multiplier = max(multiplier * factor, min_factor); then no trigger for `cooldown`
    steps, so the smaller LR can act before the detector judges again. With `on_grad_surge`, a step
    flagged by a gradient-norm surge detector (otbrl.stability.SurgeDetector) fires too (no patience;
    the same cooldown). A missing or non-finite length counts as a step without an observation.
    Each trigger is appended to `triggers` and logged (logger "otbrl.stability", level WARNING).
    `state_dict` / `load_state_dict` carry everything through checkpoints (JSON-serialisable).
    """

    def __init__(
        self,
        factor: float = 0.5,
        threshold: float = 1.25,
        zscore: float = 3.0,
        smoothing: float = 0.2,
        window: int = 50,
        warmup: int = 20,
        patience: int = 3,
        cooldown: int = 20,
        min_factor: float = 0.1,
        on_grad_surge: bool = False,
    ) -> None:
        for name, value, ok, rule in (
            ("factor", factor, 0 < factor < 1, "in (0, 1)"),
            ("threshold", threshold, threshold >= 1, ">= 1"),
            ("zscore", zscore, zscore >= 0, ">= 0"),
            ("smoothing", smoothing, 0 < smoothing <= 1, "in (0, 1]"),
            ("window", window, window >= 1, ">= 1"),
            ("warmup", warmup, 1 <= warmup <= window, "in [1, window]"),
            ("patience", patience, patience >= 1, ">= 1"),
            ("cooldown", cooldown, cooldown >= 0, ">= 0"),
            ("min_factor", min_factor, 0 < min_factor <= 1, "in (0, 1]"),
        ):
            if not ok:
                raise ValueError(f"{name}: must be {rule}, got {value!r}")
        self.config: dict[str, Any] = {
            "factor": float(factor),
            "threshold": float(threshold),
            "zscore": float(zscore),
            "smoothing": float(smoothing),
            "window": int(window),
            "warmup": int(warmup),
            "patience": int(patience),
            "cooldown": int(cooldown),
            "min_factor": float(min_factor),
            "on_grad_surge": bool(on_grad_surge),
        }
        self.history: deque[float] = deque(maxlen=int(window))
        self.ema: float | None = None
        self.multiplier = 1.0
        self.steps = 0  # calls to step()
        self.streak = 0  # consecutive high steps
        self.cooldown_left = 0
        self.fired: str | None = None  # the reason the latest step fired ("length" or "grad_norm"), or None
        self.triggers: list[dict[str, Any]] = []

    def baseline(self) -> tuple[float, float] | None:
        """(median, sigma) of the recent lengths, or None before `warmup` lengths were seen."""
        if len(self.history) < self.config["warmup"]:
            return None
        x = list(self.history)
        diffs = [b - a for a, b in zip(x, x[1:], strict=False)]
        if not diffs:
            return statistics.median(x), 0.0
        center = statistics.median(diffs)
        mad = statistics.median(abs(d - center) for d in diffs)
        return statistics.median(x), _MAD_TO_STD * mad / math.sqrt(2)  # a difference has variance 2 sigma^2

    def _is_high(self, length: float) -> bool:
        base = self.baseline()
        if base is None or self.ema is None:
            return False
        median, sigma = base
        c = self.config
        smoothed = self.ema > c["threshold"] * median and self.ema > median + c["zscore"] * sigma
        return smoothed and length > c["threshold"] * median

    def step(self, mean_length: float | torch.Tensor | None, grad_surge: bool = False) -> float:
        """Observe one step's mean response length; returns the learning-rate multiplier to use from now."""
        c = self.config
        length = None if mean_length is None else float(mean_length)
        if length is not None and math.isfinite(length):
            if length < 0:
                raise ValueError(f"mean_length: must be >= 0, got {length!r}")
            self.ema = length if self.ema is None else self.ema + c["smoothing"] * (length - self.ema)
            self.streak = self.streak + 1 if self._is_high(length) else 0
            self.history.append(length)  # after the test: the baseline is the history before this step
        self.fired = None
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
        elif self.streak >= c["patience"]:
            self.fired = "length"
        elif grad_surge and c["on_grad_surge"]:
            self.fired = "grad_norm"
        if self.fired:
            self._fire()
        self.steps += 1
        return self.multiplier

    def _fire(self) -> None:
        c = self.config
        base = self.baseline()
        self.multiplier = max(self.multiplier * c["factor"], c["min_factor"])
        self.streak, self.cooldown_left = 0, c["cooldown"]
        record = {
            "step": self.steps,
            "reason": self.fired,
            "ema": self.ema,
            "median": base[0] if base else None,
            "multiplier": self.multiplier,
        }
        self.triggers.append(record)
        median = "n/a" if base is None else f"{base[0]:.1f}"
        logger.warning(
            "length-surge LR decay at step %d (%s): smoothed length %s vs median %s; LR multiplier now %.4g",
            self.steps,
            self.fired,
            "n/a" if self.ema is None else f"{self.ema:.1f}",
            median,
            self.multiplier,
        )

    def update(
        self,
        mean_length: float | torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        grad_surge: bool = False,
    ) -> float:
        """`step`, then apply any change of the multiplier to the optimizer (and scheduler): one call per
        step after `scheduler.step()` in a plain torch loop. Returns the multiplier."""
        before = self.multiplier
        after = self.step(mean_length, grad_surge)
        scale_learning_rate(optimizer, scheduler, after / before)
        return after

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": dict(self.config),
            "history": list(self.history),
            "ema": self.ema,
            "multiplier": self.multiplier,
            "steps": self.steps,
            "streak": self.streak,
            "cooldown_left": self.cooldown_left,
            "fired": self.fired,
            "triggers": [dict(t) for t in self.triggers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state, its configuration included. The multiplier is not re-applied to any
        optimizer: the optimizer and scheduler states saved with it already carry it."""
        self.__init__(**state["config"])
        self.history.extend(state["history"])
        self.ema, self.multiplier = state["ema"], float(state["multiplier"])
        self.steps, self.streak = int(state["steps"]), int(state["streak"])
        self.cooldown_left, self.fired = int(state["cooldown_left"]), state["fired"]
        self.triggers = [dict(t) for t in state["triggers"]]


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any, ratio: float) -> None:
    """Multiply the learning rate by `ratio` from the next optimizer step on, in a way the scheduler keeps.

    An LR scheduler such as LambdaLR (every schedule of transformers' Trainer but reduce_lr_on_plateau)
    rewrites each param group's lr as base_lr * lambda(step) at every step, so scaling the lr alone
    would last one step: the scheduler's `base_lrs` are scaled too. Chainable schedulers (StepLR,
    ExponentialLR, ReduceLROnPlateau) build on the current lr and keep the change as it is. Both end up in
    the optimizer's and scheduler's own state_dicts, so a checkpoint carries the decay. `scheduler` may be
    None, or wrapped (accelerate's AcceleratedScheduler). Schedulers that keep their own peak rates
    (OneCycleLR, CyclicLR) are not supported.
    """
    if not (ratio > 0 and math.isfinite(ratio)):
        raise ValueError(f"ratio: must be a positive finite number, got {ratio!r}")
    if ratio == 1:
        return
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].mul_(ratio)  # in place: a tensor lr may be captured (e.g. by a CUDA graph)
        else:
            group["lr"] *= ratio
    inner = getattr(scheduler, "scheduler", scheduler)
    if inner is None:
        return
    if hasattr(inner, "base_lrs"):
        inner.base_lrs = [lr * ratio for lr in inner.base_lrs]
    if hasattr(inner, "_last_lr"):  # what get_last_lr() reports (and the Trainer logs) for the next step
        inner._last_lr = [float(group["lr"]) for group in optimizer.param_groups]
