"""User-level DP-SGD (UserPoissonLots, UserMeanLoss): a user's whole contribution moves the release by at
most C, and ε is reported over users (q over users, N = the number of users)."""

import keras
import numpy as np
import pytest

import keras_dpsgd
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon, default_delta
from keras_dpsgd.step.user_lots import UserMeanLoss, UserPoissonLots

C, M = 0.5, 40
LOSS = UserMeanLoss(keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6)).astype("float32")
    y = rng.integers(3, size=120)
    users = np.concatenate([np.zeros(M, int), 1 + np.arange(80) // 4])  # user 0 owns 40 examples, 20 users own 4
    return 10.0 * x, y, users  # large inputs: every gradient is clipped


def _weights():
    keras.utils.set_random_seed(3)
    return _model().get_weights()


def _model():
    return keras.Sequential([keras.Input((M, 6)), keras.layers.Dense(3)])


def _release(x, y, users, weights):
    """Σ of the clipped user gradients of one lot holding every user (q = 1, σ = 0, SGD with rate 1)."""
    lots = UserPoissonLots(x, y, users, expected_users_per_lot=len(np.unique(users)), max_examples_per_user=M, seed=0)
    model = keras_dpsgd.make_private(_model())
    model.set_weights(weights)
    optimizer = lots.configure(keras_dpsgd.DPSGDOptimizer(C, 0.0, learning_rate=1.0))
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    moved = np.concatenate([(w0 - w1).ravel() for w0, w1 in zip(weights, model.get_weights())])
    return moved * lots.expected_lot_size  # the update is Σ / L


@pytest.fixture(scope="module")
def releases():
    x, y, users = _data()
    weights = _weights()
    keep = users != 0
    return {
        "all": _release(x, y, users, weights),
        "without user 0": _release(x[keep], y[keep], users[keep], weights),
        # the same 40 examples as 40 users of one example each (example-level)
        "as examples": _release(x, y, np.where(users == 0, 1000 + np.arange(120), users), weights),
    }


def test_removing_a_user_with_many_examples_moves_the_release_by_at_most_c(releases):
    moved = np.linalg.norm(releases["all"] - releases["without user 0"])
    assert 0.9 * C < moved <= C * (1 + 1e-5)  # clipped once: about C, never more (float32 rounding bounded)
    # the check could fail: counted as 40 examples, the same data move the release by far more than C
    assert np.linalg.norm(releases["as examples"] - releases["without user 0"]) > 5 * C


def test_epsilon_is_reported_over_users(tmp_path):
    x, y, users = _data()
    lots = UserPoissonLots(x, y, users, expected_users_per_lot=5, max_examples_per_user=M)
    assert lots.num_users == 21 and lots.sampling_rate == 5 / 21
    model = keras_dpsgd.make_private(_model())
    optimizer = lots.configure(keras_dpsgd.DPSGDOptimizer(C, 1.1, learning_rate=0.1))
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=2, verbose=0)
    epsilon, delta = keras_dpsgd.model_epsilon(model)  # N for the default δ: the users
    assert delta == default_delta(21)
    expected = compute_epsilon(PoissonSampledGaussianEvent(5 / 21, 1.1, 2 * lots.lots_per_epoch), delta)
    assert epsilon == expected
    assert [e.label for e in keras_dpsgd.model_privacy_ledger(model).events] == ["dp-sgd (user-level)"]
    path = str(tmp_path / "user_level.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # the label is in the saved ledger
    assert [e.label for e in keras_dpsgd.model_privacy_ledger(loaded).events] == ["dp-sgd (user-level)"]
    assert keras_dpsgd.model_epsilon(loaded)[0] == epsilon


@pytest.mark.parametrize(
    "change,match",
    [
        (
            {"user_ids": np.zeros(119)},
            r"user_ids must give one user id per example, shape \(120,\), got shape \(119,\)",
        ),
        ({"user_ids": None}, r"user_ids must give one user id per example"),
        ({"max_examples_per_user": 39}, r"max_examples_per_user must be at least .* \(40, user 0\), got 39"),
        ({"y": -np.ones(120, int)}, r"y must be integer class labels >= 0"),
        ({"sampling_rate": 0.5}, r"UserPoissonLots takes expected_users_per_lot"),
        ({"expected_users_per_lot": 22}, r"expected_users_per_lot must be in \(0, 21\], got 22"),
    ],
)
def test_unprovable_grouping_is_refused(change, match):
    x, y, users = _data()
    kwargs = dict(x=x, y=y, user_ids=users, expected_users_per_lot=5)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        UserPoissonLots(**kwargs)
