"""Membership inference on a trained model: metrics against scikit-learn, the callback, bad input."""

import numpy as np
import pytest
import tf_keras as keras
from sklearn.metrics import roc_auc_score, roc_curve

from keras_dpsgd.audit import MembershipInferenceCallback, membership_inference
from keras_dpsgd.audit.membership import _roc, attack_features


@pytest.fixture(scope="module")
def overfit():
    """A 256-unit MLP trained without privacy on 300 random-label noise images: it memorizes them."""
    rng = np.random.default_rng(0)
    x, y = rng.random((450, 8, 8, 1), dtype=np.float32), rng.integers(0, 10, 450)
    keras.utils.set_random_seed(0)
    members, non_members = (x[:300], y[:300]), (x[300:], y[300:])
    model = keras.Sequential(
        [
            keras.layers.Flatten(input_shape=(8, 8, 1)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = MembershipInferenceCallback(members, non_members, every=20, verbose=0, confidence=0.95)
    model.fit(*members, epochs=40, batch_size=32, verbose=0, callbacks=[cb])
    return model, members, non_members, cb


def test_reports_match_sklearn_and_the_memorization_shows(overfit):
    model, members, non_members, _ = overfit
    reports = membership_inference(model, members, non_members, delta=1e-5, confidence=0.95)
    assert set(reports) == {"loss", "trained"}
    features = np.concatenate([attack_features(model, *members), attack_features(model, *non_members)])
    member = np.r_[np.ones(300, bool), np.zeros(150, bool)]
    loss = reports["loss"]
    assert loss.auc == pytest.approx(roc_auc_score(member, -features[:, 0]))
    fpr, tpr, _ = roc_curve(member, -features[:, 0])
    assert loss.advantage == pytest.approx(np.max(tpr - fpr))
    assert loss.tpr_at_fpr[0.01] == pytest.approx(tpr[fpr <= 0.01].max())
    for r in reports.values():
        assert r.auc > 0.9 and r.epsilon_lower_bound > 0.5 and 0 <= r.advantage <= 1 and r.epsilon_lower_bound >= 0
        assert r.members == 300 and r.non_members == 150
        assert set(r.to_dict()) >= {"auc", "advantage", "tpr_at_fpr", "epsilon_lower_bound", "confidence"}


def test_roc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    s, m = rng.integers(0, 5, 200).astype(float), rng.random(200) < 0.5
    fpr, tpr = _roc(s, m)
    f2, t2, _ = roc_curve(m, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, f2)
    np.testing.assert_allclose(tpr, t2)


def test_callback_runs_every_k_epochs(overfit):
    *_, cb = overfit
    assert [epoch for epoch, _ in cb.history] == [20, 40]
    assert set(cb.history[-1][1]) == {"loss", "trained"}


def test_bad_input_is_refused(overfit):
    model, members, non_members, _ = overfit
    with pytest.raises(ValueError, match="methods"):
        membership_inference(model, members, non_members, methods=("shadow",))
    with pytest.raises(ValueError, match="confidence"):
        membership_inference(model, members, non_members, confidence=1.5)
    with pytest.raises(ValueError, match="every"):
        MembershipInferenceCallback(members, non_members, every=0)


def test_every_audit_name_imports():
    import keras_dpsgd.audit as audit

    assert [name for name in audit.__all__ if getattr(audit, name, None) is None] == []
