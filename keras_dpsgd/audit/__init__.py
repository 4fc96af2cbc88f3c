"""Empirical privacy auditing: measure a lower bound ε_emp on the privacy loss and check it against ε.

The ε the accountant reports is an upper bound proven under assumptions
(Poisson lots, noise as documented, every data access in the ledger). An
attack's success implies a LOWER bound ε_emp; a correct implementation
always has ε_emp <= ε (up to the stated confidence), and ε_emp > ε exposes
a bug that the accountant cannot see.

1. :mod:`~keras_dpsgd.audit.statistics` (pure numpy/scipy): Clopper–Pearson
   bounds, ε from (TPR, FPR), and the one-run bound of Steinke, Nasr and
   Jagielski (2023).
2. :mod:`~keras_dpsgd.audit.membership`: membership inference on a trained
   model (loss threshold and a trained logistic-regression attack), and a
   callback that runs it every k epochs.
3. :mod:`~keras_dpsgd.audit.one_run` and :mod:`~keras_dpsgd.audit.canaries`:
   the one-run canary audit with gradient (Dirac) canaries in the DP-SGD step
   or input canaries in the data.
4. :mod:`~keras_dpsgd.audit.step`: the white-box step audit (Nasr et al. 2023): the noised release of
   every step against the claimed Gaussian mechanism; the strongest mode, it assumes the noise's form.

Every audit run is itself a training run on the data: its ε is its own.

Names are imported lazily: the statistics import neither TensorFlow nor
scikit-learn.
"""

from keras_dpsgd import _lazy

_LAZY = {
    # statistics (pure numpy/scipy)
    "clopper_pearson_lower": "keras_dpsgd.audit.statistics",
    "clopper_pearson_upper": "keras_dpsgd.audit.statistics",
    "clopper_pearson_interval": "keras_dpsgd.audit.statistics",
    "epsilon_from_rates": "keras_dpsgd.audit.statistics",
    "epsilon_lower_bound_from_counts": "keras_dpsgd.audit.statistics",
    "one_run_p_value": "keras_dpsgd.audit.statistics",
    "one_run_epsilon": "keras_dpsgd.audit.statistics",
    "one_run_guesses": "keras_dpsgd.audit.statistics",
    "one_run_audit": "keras_dpsgd.audit.statistics",
    "roc_auc": "keras_dpsgd.audit.statistics",
    "gdp_delta": "keras_dpsgd.audit.statistics",
    "gdp_epsilon": "keras_dpsgd.audit.statistics",
    "noise_multiplier_upper_bound": "keras_dpsgd.audit.statistics",
    "subsampled_gaussian_epsilon_lower": "keras_dpsgd.audit.statistics",
    # membership inference
    "membership_inference": "keras_dpsgd.audit.membership",
    "MembershipInferenceReport": "keras_dpsgd.audit.membership",
    "MembershipInferenceCallback": "keras_dpsgd.audit.membership",
    "attack_features": "keras_dpsgd.audit.membership",
    # one-run canary audit
    "canary_audit": "keras_dpsgd.audit.one_run",
    "CanaryAuditResult": "keras_dpsgd.audit.one_run",
    "GradientCanaryMixin": "keras_dpsgd.audit.canaries",
    "with_gradient_canaries": "keras_dpsgd.audit.canaries",
    "make_input_canaries": "keras_dpsgd.audit.canaries",
    # white-box step audit
    "step_audit": "keras_dpsgd.audit.step",
    "StepAuditResult": "keras_dpsgd.audit.step",
    "StepAuditMixin": "keras_dpsgd.audit.step",
    "with_step_audit": "keras_dpsgd.audit.step",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
