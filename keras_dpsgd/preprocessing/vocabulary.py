"""A vocabulary built with differential privacy: partition selection by Gaussian thresholding.

A ``StringLookup`` or ``TextVectorization`` adapted on the training texts publishes every token that
occurs in them (one rare token can identify a person). :func:`dp_vocabulary` releases only tokens that
many examples share, by the Gaussian thresholding mechanism of partition selection (Korolova et al.
2009 with Laplace noise; Gopi et al. 2020, "Differentially Private Set Union"; Google's DP library,
``GaussianPartitionSelection``; Wilkins et al. 2024 for its exact analysis):

1. each example contributes at most k = `max_tokens_per_example` distinct tokens (its first k
   distinct tokens after standardization and splitting), weight 1 each, so adding or removing one
   example moves the count vector by at most √k in ℓ2 norm;
2. every token that occurs gets Gaussian noise of standard deviation σ·√k on its count
   (σ = `noise_multiplier`);
3. the tokens whose noisy count exceeds τ = 1 + σ√k·Φ⁻¹((1 − δ_τ)^(1/k)) are released, most frequent
   (noisy count) first. A token of one example alone has count 1; it passes τ with probability
   1 − Φ((τ − 1)/(σ√k)), and one of the example's k tokens with probability at most
   1 − Φ((τ − 1)/(σ√k))^k = δ_τ = `threshold_delta`.

The release is (ε, δ_G(ε) + δ_τ)-DP where δ_G is the Gaussian mechanism's with noise multiplier σ
(see :class:`keras_dpsgd.accounting.GaussianThresholdingEvent`, the event recorded, which every
accountant composes as ``GaussianEvent(σ)`` plus δ_τ added to the total δ).

Usage::

    vocab = keras_dpsgd.dp_vocabulary(texts, noise_multiplier=4.0, max_tokens_per_example=8,
                                      threshold_delta=1e-6)
    layer = keras.layers.TextVectorization(output_sequence_length=32)
    vocab.apply_to(layer)           # set_vocabulary, and the release joins the model's ledger

``apply_to`` makes the layer a ``DPStringLookup`` / ``DPTextVectorization`` (registered subclasses
of the layer's own Keras class, :func:`accounted_layer_classes`) whose ``privacy_events`` hold the
release, counted by ``model_epsilon``, ``PrivacyLogger``, ``WithinLimit`` and
``make_private_with_epsilon``. The events are in the layer's config, so every save that keeps the
vocabulary (``.keras``, SavedModel, h5 models) keeps its release: the loaded layer declares it again.
Weights and checkpoints keep neither: the model built by your code gets its vocabulary (and its
release) from ``apply_to`` again.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from keras_dpsgd import _validate
from keras_dpsgd.accounting import GaussianThresholdingEvent, event_from_dict
from keras_dpsgd.dp.refusals import refuse

__all__ = [
    "AccountedVocabularyMixin",
    "DPVocabulary",
    "accounted_layer_classes",
    "dp_vocabulary",
    "thresholding_delta",
    "threshold_for_delta",
]

VOCABULARY_LABEL = "dp-vocabulary"
STANDARDIZE = ("lower_and_strip_punctuation", "lower", None)
# Keras's TextVectorization default standardization: lower case, then these characters removed.
_PUNCTUATION = re.compile(r'[!"#$%&()\*\+,-\./:;<=>?@\[\\\]^_`{|}~\']')


def _norm_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def thresholding_delta(threshold: float, noise_std: float, max_tokens_per_example: int) -> float:
    """δ_τ = 1 − Φ((τ − 1)/s)^k: the chance that one of k tokens of count 1 passes τ under noise std s."""
    if noise_std == 0.0:
        return 1.0 if threshold < 1.0 else 0.0
    return 1.0 - _norm_cdf((threshold - 1.0) / noise_std) ** max_tokens_per_example


def threshold_for_delta(delta: float, noise_std: float, max_tokens_per_example: int) -> float:
    """τ = 1 + s·Φ⁻¹((1 − δ)^(1/k)), the threshold with :func:`thresholding_delta` = δ."""
    from scipy.stats import norm

    # log1p/expm1: (1 − δ)^(1/k) without losing a small δ to rounding.
    per_token = -math.expm1(math.log1p(-delta) / max_tokens_per_example)  # 1 − (1 − δ)^(1/k)
    return 1.0 + noise_std * float(norm.isf(per_token))


@dataclasses.dataclass(frozen=True)
class DPVocabulary:
    """What :func:`dp_vocabulary` released: the tokens, most frequent first, and the privacy event.

    Attributes:
      tokens: the released tokens (noisy count > `threshold`), by decreasing noisy count.
      noise_multiplier: σ (the noise std on each count is σ·√k).
      max_tokens_per_example: k.
      threshold: τ.
      threshold_delta: δ_τ.
      event: the :class:`GaussianThresholdingEvent` of the release.
    """

    tokens: tuple
    noise_multiplier: float
    max_tokens_per_example: int
    threshold: float
    threshold_delta: float
    event: GaussianThresholdingEvent

    @property
    def privacy_events(self) -> tuple:
        return (self.event,)

    def apply_to(self, layer: Any) -> Any:
        """Sets the vocabulary of a StringLookup or TextVectorization (either Keras) and records the release.

        The layer becomes its Keras's ``DPStringLookup`` / ``DPTextVectorization`` (same state and
        behaviour, a keras_dpsgd-registered class) whose ``privacy_events`` hold the event, also in
        its config: the model's ledger counts it, the refusal of adapted vocabularies lets the
        layer pass, and a saved and loaded model still declares it. Applied again, the layer keeps
        the earlier releases too (a model may have been trained with them). Returns the layer.

        Raises:
          TypeError: `layer` is not a StringLookup or TextVectorization of tf_keras or Keras 3.
        """
        accounted = _accounted_class(layer)
        earlier = layer.privacy_events if isinstance(layer, AccountedVocabularyMixin) else ()
        layer.set_vocabulary(list(self.tokens))
        layer.__class__ = accounted  # a subclass that only adds the release to the layer's config
        layer._set_release(earlier + self.privacy_events)
        return layer


# ----------------------------------------------------------------- the layers that keep the release
_ACCOUNTED: dict = {}  # Keras class (StringLookup, TextVectorization of each Keras) -> its DP subclass


class AccountedVocabularyMixin:
    """A StringLookup/TextVectorization whose vocabulary is a DP release recorded in its config.

    ``privacy_events`` (the config entry of the same name, as event dicts) declare the releases, so
    :func:`keras_dpsgd.ledger.model_privacy_ledger` counts them and the refusal of adapted
    vocabularies passes the layer, also after a load. ``adapt`` is refused: it would replace the
    accounted vocabulary by the exact one.
    """

    def __init__(self, *args: Any, privacy_events: Sequence = (), **kwargs: Any):
        if not privacy_events:
            raise ValueError(
                f"{type(self).__name__} is made by keras_dpsgd.dp_vocabulary(...).apply_to(layer) (or loaded with "
                "its release): privacy_events must not be empty"
            )
        super().__init__(*args, **kwargs)
        events = [e if not isinstance(e, dict) else event_from_dict(e) for e in privacy_events]
        self._set_release(tuple(events))

    def _set_release(self, events: tuple) -> None:
        from keras_dpsgd.preprocessing.normalization import PUBLIC_ATTR

        object.__setattr__(self, "_dp_vocabulary_events", tuple(events))  # not tracked by Keras
        inner = getattr(self, "_lookup_layer", None)  # TextVectorization's StringLookup: its release is this one
        if inner is not None:
            setattr(inner, PUBLIC_ATTR, True)

    @property
    def privacy_events(self) -> tuple:
        return self._dp_vocabulary_events

    def get_config(self) -> dict:
        config = super().get_config()
        config["privacy_events"] = [e.to_dict() for e in self.privacy_events]
        return config

    def adapt(self, *args: Any, **kwargs: Any) -> None:
        raise refuse(
            "adapted-preprocessing",
            f"layer {self.name!r} ({type(self).__name__}) holds a vocabulary released by keras_dpsgd.dp_vocabulary: "
            "adapt would replace it by the exact vocabulary of the data, outside the privacy ledger; build a "
            "new vocabulary with dp_vocabulary(texts, ...) and apply_to(layer)",
        )


def accounted_layer_classes(kmod: Any) -> tuple:
    """(DPStringLookup, DPTextVectorization) of the Keras module `kmod` (tf_keras or keras), registered.

    Registered as "keras_dpsgd>DPStringLookup" and "keras_dpsgd>DPTextVectorization" in that Keras,
    so a saved model's layer loads as the accounted class. Called once by each front end module.
    """
    made = []
    for base in (kmod.layers.StringLookup, kmod.layers.TextVectorization):
        name = f"DP{base.__name__}"
        doc = f"A {base.__name__} whose vocabulary came from keras_dpsgd.dp_vocabulary (see AccountedVocabularyMixin)."
        cls = type(name, (AccountedVocabularyMixin, base), {"__doc__": doc, "__module__": __name__})
        cls = kmod.saving.register_keras_serializable(package="keras_dpsgd", name=name)(cls)
        _ACCOUNTED[base] = cls
        made.append(cls)
    return tuple(made)


def _accounted_class(layer: Any) -> type:
    """The DP subclass for `layer`'s exact class (its front end imported on demand)."""
    from keras_dpsgd import _registration
    from keras_dpsgd._which_keras import KERAS3, TF_KERAS
    from keras_dpsgd.ledger import is_keras3

    if isinstance(layer, AccountedVocabularyMixin):
        return type(layer)
    kind = type(layer)
    if kind not in _ACCOUNTED and callable(getattr(layer, "set_vocabulary", None)):
        _registration.register(KERAS3 if is_keras3(layer) else TF_KERAS)
    if kind not in _ACCOUNTED:
        raise TypeError(
            "layer must be a StringLookup or TextVectorization of tf_keras or Keras 3 (exactly that class, "
            f"not a subclass), got {kind.__module__}.{kind.__name__}"
        )
    return _ACCOUNTED[kind]


def _tokens(text: Any, standardize: Optional[str]) -> list:
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if not isinstance(text, str):  # a sequence of tokens, already split
        return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in text]
    if standardize is not None:
        text = text.lower()
        if standardize == "lower_and_strip_punctuation":
            text = _PUNCTUATION.sub("", text)
    return text.split()


def _distinct_first(tokens: Sequence[str], k: int) -> list:
    """The first k distinct tokens of one example: its contribution, bounded by construction."""
    return list(dict.fromkeys(tokens))[:k]


def dp_vocabulary(
    texts: Iterable[Any],
    *,
    noise_multiplier: float,
    max_tokens_per_example: int,
    threshold_delta: float,
    max_tokens: Optional[int] = None,
    standardize: Optional[str] = "lower_and_strip_punctuation",
    seed: Optional[int] = None,
) -> DPVocabulary:
    """A vocabulary of `texts` released by Gaussian thresholding (module docstring), with its event.

    Args:
      texts: the training texts, one per example (str or bytes), or one sequence of tokens per example.
        Every example must appear once.
      noise_multiplier: σ > 0; the noise std on each count is σ·√k.
      max_tokens_per_example: k >= 1, the distinct tokens an example may contribute (its first k).
      threshold_delta: δ_τ in (0, 1), the δ the thresholding adds to the total δ (keep it well below
        the δ you report, e.g. a tenth of it).
      max_tokens: keep at most this many tokens, the most frequent (post-processing); None: all.
      standardize: "lower_and_strip_punctuation" (Keras's TextVectorization default), "lower" or None;
        strings are then split on whitespace. Ignored for pre-split token sequences.
      seed: None (OS entropy) or an integer for a reproducible noise draw (keep it secret).

    Returns:
      A :class:`DPVocabulary`.

    Raises:
      ValueError/TypeError: an argument out of range (named).
    """
    sigma = _validate.positive(noise_multiplier=noise_multiplier)
    k = _validate.integer_at_least(1, max_tokens_per_example=max_tokens_per_example)
    delta = _validate.in_range(0, 1, "()", threshold_delta=threshold_delta)
    if max_tokens is not None:
        max_tokens = _validate.integer_at_least(1, max_tokens=max_tokens)
    standardize = _validate.one_of(STANDARDIZE, standardize=standardize)
    if seed is not None:
        seed = _validate.integer_at_least(0, seed=seed)
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of texts (one per example), got a single string")
    counts: dict = {}
    for text in texts:
        for token in _distinct_first(_tokens(text, standardize), k):
            counts[token] = counts.get(token, 0) + 1
    std = sigma * math.sqrt(k)
    tau = threshold_for_delta(delta, std, k)
    delta = max(delta, thresholding_delta(tau, std, k))  # never below the threshold's own δ (rounding)
    rng = np.random.default_rng(seed)
    names = sorted(counts)  # a fixed order: the noise does not depend on the order of the texts
    noisy = np.array([counts[t] for t in names], np.float64) + rng.normal(0.0, std, len(names))
    kept = [(value, name) for value, name in zip(noisy, names) if value > tau]
    kept.sort(key=lambda pair: -pair[0])
    tokens = tuple(name for _, name in kept[:max_tokens])
    event = GaussianThresholdingEvent(sigma, delta, label=VOCABULARY_LABEL)
    return DPVocabulary(tokens, sigma, k, tau, delta, event)
