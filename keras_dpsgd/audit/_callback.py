"""The membership-inference callback's behaviour, shared by the tf_keras and Keras 3 classes."""

from __future__ import annotations

from keras_dpsgd import _validate as V

__all__ = ["MembershipInferenceCallbackCore"]


class MembershipInferenceCallbackCore:
    """Runs :func:`membership_inference` every `every` epochs and keeps the history.

    The attack reads the model and the data: running it is itself an access
    to the training data outside the DP-SGD ledger. Its numbers are for the
    developer's eyes (like the loss in the progress bar); publish ε, not them.

    Args:
      members, non_members: as for :func:`membership_inference`.
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
        from keras_dpsgd.audit.membership import membership_inference

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
