"""Membership inference on a trained model: loss threshold and a trained attack.

Given the training set ("members") and held-out data of the same
distribution ("non-members"), an attack scores every example; the report
gives the ROC AUC, the best attacker advantage max(TPR − FPR) (Yeom et al.
2018), TPR at FPR 1% and 0.1% (Carlini et al. 2022: the low-FPR regime is
what matters), and an ε lower bound.

* ``loss``: the loss-threshold attack (Yeom et al. 2018): score −loss.
* ``trained``: scikit-learn logistic regression on per-example features
  (loss, probability of the label, largest probability, entropy), scored out
  of fold by stratified k-fold cross-validation (every example is scored by a
  model that did not see it).

The ε lower bound: the threshold is chosen on one random half of the
examples (the one whose bound is largest there) and the rates are
counted on the other half, with Clopper–Pearson bounds
(:func:`keras_dpsgd.audit.statistics.epsilon_lower_bound_from_counts`).
**It is indicative, not a proof**: the bound is exact for independent
trials, but the examples of one model are not independent trials of one
training run, and a fixed train/held-out split is not the random inclusion
the DP guarantee speaks of. For a bound with a theorem behind it, use the
one-run canary audit (:func:`keras_dpsgd.audit.canary_audit`).
"""

from __future__ import annotations

import dataclasses
import threading
import types
from typing import Any

import numpy as np

from keras_dpsgd import _validate as V
from keras_dpsgd.audit import statistics

__all__ = [
    "MembershipInferenceCallback",  # noqa: F822 (tf_keras's, defined at first access, by __getattr__)
    "MembershipInferenceReport",
    "attack_features",
    "membership_inference",
]

METHODS = ("loss", "trained")
_LOW_FPRS = (0.01, 0.001)


@dataclasses.dataclass
class MembershipInferenceReport:
    """One attack's results (see the module docstring).

    Attributes:
      method: "loss" or "trained".
      auc: ROC AUC (0.5: no better than chance).
      advantage: max over thresholds of TPR − FPR.
      tpr_at_fpr: {FPR: TPR} at FPR 1% and 0.1% (the largest TPR with FPR <=
        the target; 0 when there are too few non-members to reach it).
      epsilon_lower_bound: the indicative ε lower bound at `confidence`.
      confidence, delta: of the bound.
      members, non_members: counts.
    """

    method: str
    auc: float
    advantage: float
    tpr_at_fpr: dict
    epsilon_lower_bound: float
    confidence: float
    delta: float
    members: int
    non_members: int

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tpr_at_fpr"] = {str(k): v for k, v in self.tpr_at_fpr.items()}
        return d


def attack_features(model: Any, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> np.ndarray:
    """Per-example [loss, p(label), max p, entropy] from the model's logits, shape [n, 4]."""
    import tensorflow as tf

    rows = []
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch], training=False)
        logits = logits.detach().cpu().numpy() if hasattr(logits, "detach") else logits  # torch: off the tape
        logits = tf.convert_to_tensor(logits, tf.float32)
        log_p = tf.nn.log_softmax(logits).numpy().astype(np.float64)
        p = np.exp(log_p)
        label = np.asarray(y[i : i + batch], np.int64)
        own = log_p[np.arange(len(label)), label]
        rows.append(np.stack([-own, np.exp(own), p.max(axis=1), -(p * log_p).sum(axis=1)], axis=1))
    return np.concatenate(rows) if rows else np.zeros([0, 4])


def _roc(scores: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) at every threshold "score >= t", from the strictest, with (0, 0) first."""
    order = np.argsort(-scores, kind="stable")
    s, m = scores[order], member[order]
    last = np.r_[np.flatnonzero(np.diff(s) != 0), len(s) - 1]  # a threshold between distinct scores
    tp = np.r_[0, np.cumsum(m)[last]]
    fp = np.r_[0, np.cumsum(~m)[last]]
    return fp / max(1, (~member).sum()), tp / max(1, member.sum())


def _tpr_at(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    ok = fpr <= target
    return float(tpr[ok].max()) if ok.any() else 0.0


def _epsilon_bound(scores, member, delta, confidence, rng) -> float:
    """Threshold chosen on one half, rates counted on the other (see the module docstring)."""
    half = rng.permutation(len(scores)) < len(scores) // 2
    if min(member[half].sum(), (~member[half]).sum(), member[~half].sum(), (~member[~half]).sum()) == 0:
        return 0.0
    s1, m1 = scores[half], member[half]
    best_t, best_eps = None, -1.0
    for t in np.unique(s1):
        eps = _epsilon_at_threshold(s1, m1, t, delta, confidence)
        if eps > best_eps:
            best_t, best_eps = t, eps
    return _epsilon_at_threshold(scores[~half], member[~half], best_t, delta, confidence)


def _epsilon_at_threshold(scores, member, threshold, delta, confidence) -> float:
    """The ε lower bound of the guess "member iff score >= threshold", from its true and false positives."""
    pred = scores >= threshold
    return statistics.epsilon_lower_bound_from_counts(
        int(pred[member].sum()),
        int(member.sum()),
        int(pred[~member].sum()),
        int((~member).sum()),
        delta=delta,
        confidence=confidence,
    )


def _trained_scores(features: np.ndarray, member: np.ndarray, folds: int, seed: int) -> np.ndarray:
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    folds = int(min(folds, member.sum(), (~member).sum()))
    if folds < 2:
        raise ValueError(
            f"the trained attack needs >= 2 members and 2 non-members, got {int(member.sum())} and "
            f"{int((~member).sum())}"
        )
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
    cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    return cross_val_predict(clf, features, member, cv=cv, method="decision_function")


def membership_inference(
    model: Any,
    members: tuple[np.ndarray, np.ndarray],
    non_members: tuple[np.ndarray, np.ndarray],
    *,
    methods: tuple[str, ...] = METHODS,
    delta: float = 0.0,
    confidence: float = 0.95,
    folds: int = 5,
    seed: int = 0,
) -> dict[str, MembershipInferenceReport]:
    """Runs the attacks against `model`; returns one report per method.

    Args:
      model: a Keras 3 or tf_keras classifier that outputs logits.
      members: (x, y) of training examples.
      non_members: (x, y) of held-out examples never trained on.
      methods: a subset of ("loss", "trained").
      delta: δ of the ε bound.
      confidence: of the ε bound, in (0, 1).
      folds: cross-validation folds of the trained attack.
      seed: of the cross-validation folds and the threshold split (public
        choices of the auditor; they touch no privacy randomness).

    Raises:
      ValueError: unknown method, empty inputs, bad confidence or delta.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty subset of {list(METHODS)}, got {list(methods)}")
    confidence = statistics.check_confidence(confidence)
    delta = V.in_range(0, 1, "[)", delta=delta)
    if len(members[0]) < 1 or len(non_members[0]) < 1:
        raise ValueError(f"members and non_members must be non-empty, got {len(members[0])} and {len(non_members[0])}")
    features = np.concatenate([attack_features(model, *members), attack_features(model, *non_members)])
    member = np.r_[np.ones(len(members[0]), bool), np.zeros(len(non_members[0]), bool)]
    reports = {}
    for method in methods:
        scores = -features[:, 0] if method == "loss" else _trained_scores(features, member, folds, seed)
        fpr, tpr = _roc(scores, member)
        reports[method] = MembershipInferenceReport(
            method=method,
            auc=statistics.roc_auc(scores, member),
            advantage=float(np.max(tpr - fpr)),
            tpr_at_fpr={f: _tpr_at(fpr, tpr, f) for f in _LOW_FPRS},
            epsilon_lower_bound=_epsilon_bound(scores, member, delta, confidence, np.random.default_rng(seed)),
            confidence=confidence,
            delta=delta,
            members=int(member.sum()),
            non_members=int((~member).sum()),
        )
    return reports


class MembershipInferenceCallbackCore:
    """Runs :func:`membership_inference` every `every` epochs and keeps the history.

    The attack reads the model and the data: running it is itself an access
    to the training data outside the DP-SGD ledger. Its numbers are for the
    developer's eyes (like the loss in the progress bar); publish ε, not them.

    Args:
      members: as for :func:`membership_inference`.
      non_members: as for :func:`membership_inference`.
      every: k >= 1, run after epochs k, 2k, ...
      verbose: print one line per run.
      **kwargs: passed to :func:`membership_inference`.

    Attributes:
      history: list of (epoch, {method: MembershipInferenceReport}).
    """

    def __init__(self, members, non_members, *, every: int = 1, verbose: int = 1, **kwargs):
        super().__init__()
        every = V.integer_at_least(1, every=every)
        self.members, self.non_members, self.every, self.verbose = members, non_members, every, verbose
        self.kwargs = kwargs
        self.history: list = []

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every:
            return
        reports = membership_inference(self.model, self.members, self.non_members, **self.kwargs)
        self.history.append((epoch + 1, reports))
        if logs is not None:
            for method, r in reports.items():
                logs[f"mia_{method}_auc"] = r.auc
        if self.verbose:
            text = ", ".join(
                f"{m}: AUC {r.auc:.3f}, adv {r.advantage:.3f}, TPR@1% {r.tpr_at_fpr[0.01]:.3f}, "
                f"ε_emp {r.epsilon_lower_bound:.3g}"
                for m, r in reports.items()
            )
            print(f"\nepoch {epoch + 1} membership inference: {text}")


_DEFINE_LOCK = threading.Lock()


def __getattr__(name: str) -> Any:
    """``MembershipInferenceCallback``, tf_keras's, defined at its first use (PEP 562).

    So this module (and the attack, which takes a model of either Keras) imports without tf_keras;
    Keras 3's callback is ``keras_dpsgd.keras3.MembershipInferenceCallback``.
    """
    if name != "MembershipInferenceCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _DEFINE_LOCK:
        if name not in globals():
            from keras_dpsgd._which_keras import import_tf_keras

            namespace = {
                "__doc__": MembershipInferenceCallbackCore.__doc__
                + "\n    tf_keras; Keras 3: ``keras_dpsgd.keras3.MembershipInferenceCallback``.\n",
                "__module__": __name__,
                "__qualname__": name,
            }
            bases = (MembershipInferenceCallbackCore, import_tf_keras().callbacks.Callback)
            globals()[name] = types.new_class(name, bases, exec_body=lambda ns: ns.update(namespace))
    return globals()[name]
