"""A learned escalation rule: predict from the edge's outputs whether the cloud would answer otherwise.

Every answered escalation and every audit is a label the cloud gives for free: did its top-1 differ
from the edge's? `Router` fits a logistic regression of that on features of the edge's logits
(max probability, margin, normalised entropy, the second and third probabilities, the log-odds of the
top one, the energy score -logsumexp, and which class is the top one: a shift often makes the edge wrong
on some classes more than others), each labelled row weighted by the inverse of the probability it
had to be labelled (1 for an escalation, 1/audit_rate for an audit), so that the fit describes the
whole stream and not only the unsure region the escalations come from.

Champion and challenger, judged by cross-fitting: the labelled rows are split in two folds (alternate
rows), a model is fitted on each, and every recent labelled row is scored by the model that did not see
it; so every row is held out for the verdict and every row trains the deployed fit (fitted on both folds).
The verdict is a paired comparison at the escalation rate in force: each rule flags its riskiest `rate`
share of the (weighted) judged rows, and d_i = w_i y_i (learned flags i - configured flags i) counts the
disagreements one catches and the other misses. The learned rule becomes champion when the one-sided
lower confidence bound of Σd is above zero (Σd > z·sqrt(n·var(d)), z = 1.645: a 5 % false-switch rate
per look on rows where both rules are equally good), and gives way when that bound is no longer met. The
verdict is taken at every refit (repeated looks: `tests/edge_agent/test_router.py` measures the false
switches of a whole stream, A/A, and the power against a rule that misses what the edge's class tells).

The fit is refit by a few Newton steps on a window of recent labelled rows (background work, in the
agent's fold); scoring one row is plain Python over the few classes (~10 µs; `bench/bench_router.py`
measures it). The state (weights, feature scaling, the verdict) is saved as JSON; a release may ship one.

Example:
    >>> router = Router(RouterOptions(path=state_dir / "router.json"))
    >>> router.learn(logits, disagreed, weights)
    >>> router.refit(rate=0.2)
    >>> risk = router.risk_row(logits[0].tolist())
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.errors import ConfigError

logger = logging.getLogger(__name__)

FEATURES = ("bias", "max_prob", "margin", "certainty", "p2", "p3", "log_odds", "energy")
_LOG_ODDS_CAP = 12.0
STATE_VERSION = 2
_BASE = len(FEATURES)


def features(logits: np.ndarray) -> np.ndarray:
    """(N, K) logits -> (N, len(FEATURES) + K) raw features (energy unscaled), the last K the top class one-hot."""
    z = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    top = z.max(axis=1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=1)
    p = e / total[:, None]
    ps = -np.sort(-p, axis=1)
    k = z.shape[1]
    p1 = ps[:, 0]
    p2 = ps[:, 1] if k > 1 else np.zeros_like(p1)
    p3 = ps[:, 2] if k > 2 else np.zeros_like(p1)
    h = np.log(total) - (e * (z - top)).sum(axis=1) / total
    cert = 1.0 - h / math.log(max(k, 2))
    lo = np.clip(np.log(np.maximum(p1, 1e-300)) - np.log(np.maximum(1.0 - p1, 1e-300)), -_LOG_ODDS_CAP,
                 _LOG_ODDS_CAP) / _LOG_ODDS_CAP
    energy = -(top[:, 0] + np.log(total))
    onehot = np.zeros((len(z), k))
    onehot[np.arange(len(z)), z.argmax(axis=1)] = 1.0
    return np.column_stack([np.ones_like(p1), p1, p1 - p2, cert, p2, p3, lo, energy, onehot])


def _row_features(row: list[float]) -> list[float]:
    """`features` for one row of a few classes, in plain Python (the per-request path), less the one-hot."""
    top = max(row)
    e = [math.exp(v - top) for v in row]
    total = sum(e)
    inv = 1.0 / total
    ps = sorted(e, reverse=True)
    p1 = ps[0] * inv
    p2 = ps[1] * inv if len(ps) > 1 else 0.0
    p3 = ps[2] * inv if len(ps) > 2 else 0.0
    log_total = math.log(total)
    # H = log(sum e) - sum(e * (z - top)) / sum(e)
    h = log_total - (sum(map(operator.mul, e, row)) * inv - top)
    cert = 1.0 - h / math.log(max(len(row), 2))
    lo = math.log(p1) - math.log(1.0 - p1) if 0.0 < p1 < 1.0 else (_LOG_ODDS_CAP if p1 >= 1.0 else -_LOG_ODDS_CAP)
    lo = max(-_LOG_ODDS_CAP, min(_LOG_ODDS_CAP, lo)) / _LOG_ODDS_CAP
    return [1.0, p1, p1 - p2, cert, p2, p3, lo, -(top + log_total)]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = 0.5 * (1.0 + np.tanh(0.5 * x))
    return out


def caught_at_rate(risk: np.ndarray, y: np.ndarray, w: np.ndarray, rate: float) -> np.ndarray:
    """Per row: weight x label where the row is among the riskiest `rate` share of the weight, else 0."""
    order = np.argsort(-risk, kind="stable")
    cum = np.cumsum(w[order])
    flagged = np.zeros(len(risk), dtype=bool)
    if len(cum):
        flagged[order[cum <= rate * cum[-1] + 1e-12]] = True
    out: np.ndarray = np.where(flagged, w * y, 0.0)
    return out


@dataclass(frozen=True)
class RouterOptions:
    """The learned rule's knobs.

    Args:
        path: where its state is saved (the agent's state directory) and loaded from at start; None: not kept.
        initial: a state trained offline (shipped with a release), loaded when `path` holds none yet.
        window: the most recent labelled rows it is fitted on.
        holdout_window: the most recent labelled rows judged (each by the fold model that did not see it).
        min_holdout: judged rows (and `min_positives` weighted disagreements) before any verdict.
        min_positives: see `min_holdout`.
        z: the challenger wins when its gain exceeds this many standard errors of the paired difference
            (1.645: a one-sided 5 % test).
        l2: ridge penalty of the fit (on all but the bias).
        refit_every: labelled rows between refits.
        max_weight: importance weights are capped here (a rare huge weight must not decide alone).
    """

    path: str | Path | None = None
    initial: str | Path | None = None
    window: int = 4_000
    holdout_window: int = 2_000
    min_holdout: int = 100
    min_positives: float = 10.0
    z: float = 1.645
    l2: float = 1e-3
    refit_every: int = 32
    max_weight: float = 200.0

    def __post_init__(self) -> None:
        if not (self.window >= 16 and self.holdout_window >= 16 and self.min_holdout >= 1
                and self.z >= 0 and self.l2 >= 0 and self.refit_every >= 1 and self.max_weight >= 1):
            msg = f"RouterOptions out of range: {self!r}"
            raise ConfigError(msg)


def _newton(f: np.ndarray, y: np.ndarray, sw: np.ndarray, w: np.ndarray, l2: float, iterations: int) -> np.ndarray:
    """A few Newton steps of ridge-penalised weighted logistic regression from `w` (the bias unpenalised)."""
    reg = np.full(f.shape[1], l2 * len(y))
    reg[0] = 0.0

    def loss(v: np.ndarray) -> float:
        s = f @ v
        return float((sw * (np.logaddexp(0.0, s) - y * s)).sum() + 0.5 * (reg * v * v).sum())

    current = loss(w)
    for _ in range(iterations):
        p = _sigmoid(f @ w)
        grad = f.T @ (sw * (p - y)) + reg * w
        hess = (f * (sw * p * (1 - p))[:, None]).T @ f + np.diag(reg + 1e-6)
        step = np.linalg.solve(hess, grad)
        for _ in range(20):  # halve the step until the penalised loss falls (a separable fold diverges otherwise)
            trial = w - step
            value = loss(trial)
            if value <= current:
                break
            step = step / 2
        else:
            return w
        w, current = trial, value
    return w


class Router:
    """The learned escalation rule, its cross-fitted verdict against the configured score, and its state.

    `risk_row` (per request) reads one tuple (weights, energy scaling) that a refit replaces whole, so a
    concurrent reader sees one fit or the other.
    """

    def __init__(self, options: RouterOptions | None = None) -> None:
        self.options = o = options or RouterOptions()
        self.w = np.zeros(_BASE)
        self.energy_mu, self.energy_sd = 0.0, 1.0
        self._fit: tuple[list[float], list[float], float, float] = ([0.0] * _BASE, [], 0.0, 1.0)
        self.fitted = False
        self.champion = False  # True: the learned rule decides escalations
        self.verdict: dict[str, Any] = {}
        # (features, disagreed, weight, configured risk, row number): fold = row number % 2
        self._train: deque[tuple[np.ndarray, float, float, float, int]] = deque(maxlen=max(o.window,
                                                                                         o.holdout_window))
        self._folds: list[np.ndarray | None] = [None, None]
        self._labelled = 0
        self._judge_from = 0  # rows before this one describe a world before the last drift event
        self._since_refit = 0
        if o.path is not None and Path(o.path).exists():
            self.load(o.path)
        elif o.initial is not None and Path(o.initial).exists():
            self.load(o.initial)

    # -- scoring -------------------------------------------------------------------------------

    def risk_row(self, row: list[float]) -> float:
        """P(the cloud's top-1 differs) for one row of logits (`_row_features` and the dot product)."""
        w, wc, mu, sd = self._fit  # swapped whole by a refit: one fit, never half
        f = _row_features(row)
        f[-1] = (f[-1] - mu) / sd
        s = sum(map(operator.mul, w, f))
        if len(wc) == len(row):
            s += wc[row.index(max(row))]
        return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, s))))

    def risk(self, logits: np.ndarray) -> np.ndarray:
        return self._risk(self.w, features(logits))

    def _risk(self, w: np.ndarray, f: np.ndarray) -> np.ndarray:
        f = self._scaled(f)
        if len(w) != f.shape[1]:  # fitted on another number of classes (or not yet): the base features only
            return _sigmoid(f[:, :_BASE] @ w[:_BASE])
        return _sigmoid(f @ w)

    def _scaled(self, f: np.ndarray) -> np.ndarray:
        f = f.copy()
        f[:, _BASE - 1] = (f[:, _BASE - 1] - self.energy_mu) / self.energy_sd
        return f

    # -- learning ------------------------------------------------------------------------------

    def learn(self, logits: np.ndarray, disagreed: np.ndarray, weight: np.ndarray, config_risk: np.ndarray) -> None:
        """Labelled rows: edge logits, whether the cloud's top-1 differed, the importance weight (1/inclusion
        probability), and the configured rule's risk (1 - its score) of each row, for the verdict."""
        f = features(logits)
        w = np.minimum(np.asarray(weight, dtype=np.float64), self.options.max_weight)
        for i in range(len(f)):
            self._train.append((f[i], float(disagreed[i]), float(w[i]), float(config_risk[i]), self._labelled))
            self._labelled += 1
            self._since_refit += 1

    def due(self) -> bool:
        return self._since_refit >= self.options.refit_every

    def refit(self, rate: float, *, iterations: int = 4) -> None:
        """Refit on the recent labelled rows (a few Newton steps from the last fit; the two fold models too),
        then judge champion and challenger on the recent rows at escalation rate `rate`."""
        self._since_refit = 0
        rows = list(self._train)[-self.options.window:]
        if len(rows) < 16 or len({r[0].shape for r in rows}) != 1:
            return
        f = np.stack([t[0] for t in rows])
        y = np.array([t[1] for t in rows])
        if y.min() == y.max():  # one class only: nothing to separate yet
            return
        sw = np.array([t[2] for t in rows])
        mu = float(np.average(f[:, _BASE - 1], weights=sw))
        sd = float(math.sqrt(np.average((f[:, _BASE - 1] - mu) ** 2, weights=sw))) or 1.0
        f[:, _BASE - 1] = (f[:, _BASE - 1] - mu) / sd
        sw = sw / sw.mean()
        start = self.w if self.fitted and len(self.w) == f.shape[1] else np.zeros(f.shape[1])
        w = _newton(f, y, sw, start, self.options.l2, iterations)
        if not np.all(np.isfinite(w)):
            logger.warning("the router's fit diverged; keeping the last one")
            return
        fold = np.array([t[4] % 2 for t in rows])
        for k in (0, 1):  # cross-fitting: each fold's model, for the verdict on the other fold's rows
            prev = self._folds[k]
            mine = fold == k
            if mine.sum() >= 8 and y[mine].min() != y[mine].max():
                fk = _newton(f[mine], y[mine], sw[mine], prev if prev is not None and len(prev) == len(w) else w,
                             self.options.l2, iterations)
                self._folds[k] = fk if np.all(np.isfinite(fk)) else None
        self.energy_mu, self.energy_sd, self.w = mu, sd, w
        self._fit, self.fitted = (w[:_BASE].tolist(), w[_BASE:].tolist(), mu, sd), True
        self.judge(rate)

    def judge(self, rate: float) -> dict[str, Any]:
        """Champion (configured score) against challenger (learned) on the recent labelled rows at `rate`,
        each row scored by the fold model that was not fitted on it."""
        o = self.options
        rows = [t for t in list(self._train)[-o.holdout_window:] if t[4] >= self._judge_from]
        verdict: dict[str, Any] = {"holdout": len(rows), "rate": rate}
        folds = self._folds
        if (folds[0] is not None and folds[1] is not None and len(rows) >= o.min_holdout and 0 < rate < 1
                and len({r[0].shape for r in rows}) == 1):
            f = np.stack([t[0] for t in rows])
            y = np.array([t[1] for t in rows])
            sw = np.array([t[2] for t in rows])
            cfg = np.array([t[3] for t in rows])
            other = np.array([1 - t[4] % 2 for t in rows])
            risk = np.where(other == 0, self._risk(folds[0], f), self._risk(folds[1], f))
            positives = float((sw * y).sum())
            verdict["positives"] = positives
            if positives >= o.min_positives:
                learned = caught_at_rate(risk, y, sw, rate)
                configured = caught_at_rate(cfg, y, sw, rate)
                d = learned - configured
                se = float(math.sqrt(len(d) * d.var())) if len(d) > 1 else math.inf
                gain = float(d.sum())
                verdict.update(learned_recall=float(learned.sum() / positives),
                               configured_recall=float(configured.sum() / positives),
                               gain_se=gain / se if se > 0 else (math.inf if gain > 0 else 0.0))
                self.champion = gain > o.z * se
        verdict["champion"] = "learned" if self.champion else "configured"
        self.verdict = verdict
        return verdict

    def forget_holdout(self) -> None:
        """After a drift event the labelled rows so far describe the old world: judge on new ones only."""
        self._judge_from = self._labelled

    # -- state ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "features": list(FEATURES), "weights": self.w.tolist(),
                "energy_mu": self.energy_mu, "energy_sd": self.energy_sd, "fitted": self.fitted,
                "champion": self.champion, "verdict": self.verdict, "labelled": self._labelled}

    def save(self, path: str | Path | None = None) -> None:
        """Write the state atomically (to `path`, or the options' path)."""
        target = Path(path or self.options.path or "")
        if not str(target):
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        os.replace(tmp, target)

    def load(self, path: str | Path) -> None:
        """Read a state written by `save` (the device's, or one a release ships)."""
        try:
            doc = json.loads(Path(path).read_text())
            w = np.asarray(doc["weights"], dtype=np.float64)
            if doc.get("version") != STATE_VERSION or list(doc["features"]) != list(FEATURES) \
                    or w.ndim != 1 or len(w) < _BASE or not np.all(np.isfinite(w)):
                msg = "unknown version or features"
                raise ValueError(msg)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            msg = f"router state {path} is unreadable ({exc}); delete it to learn again from the cloud's answers"
            raise ConfigError(msg) from None
        self.w = w
        self.energy_mu, self.energy_sd = float(doc["energy_mu"]), float(doc["energy_sd"]) or 1.0
        self._fit = (w[:_BASE].tolist(), w[_BASE:].tolist(), self.energy_mu, self.energy_sd)
        self.fitted, self.champion = bool(doc["fitted"]), bool(doc["champion"])
        self.verdict, self._labelled = dict(doc.get("verdict") or {}), int(doc.get("labelled", 0))
