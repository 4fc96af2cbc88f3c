"""Keras 3: DP optimizer settings, refusals (fail closed), serialization and the ledger."""

import keras
import numpy as np
import pytest
import tf_keras

import keras_dpsgd
import keras_dpsgd.keras3 as k3
from keras_dpsgd.tf_keras import _optimizer as tf_keras_optimizers
from keras_dpsgd.accounting import PoissonSampledGaussianEvent, compute_epsilon
from keras_dpsgd.ledger import assume_poisson


def _mlp(**layer_kwargs):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, **layer_kwargs)])


def _data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def test_dp_optimizer_without_make_private_refuses_first_step():
    model = _mlp()
    opt = k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    model.compile(optimizer=opt, loss="mse")
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"keras_dpsgd\.keras3\.make_private\(model\)"):
        model.fit(*_data(), verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())  # Nothing was trained.
    assert int(opt.noised_steps.numpy()) == 0


def test_make_private_needs_a_dp_optimizer():
    model = k3.make_private(_mlp())
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="DP optimizer"):
        model.fit(*_data(), verbose=0)


def test_make_private_refuses_own_train_step_and_compute_loss():
    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    class OwnLoss(keras.Sequential):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    for cls, method in ((OwnStep, "train_step"), (OwnLoss, "compute_loss")):
        with pytest.raises(ValueError, match=f"overrides {method}.*sanitized_gradients"):
            k3.make_private(cls([keras.Input((4,)), keras.layers.Dense(3)]))


def test_make_private_refuses_tf_keras_models():
    with pytest.raises(TypeError, match="Keras 3"):
        k3.make_private(tf_keras.Sequential([tf_keras.layers.Dense(3)]))


def test_multi_output_loss_that_does_not_match_the_outputs_is_refused_clearly():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, [keras.layers.Dense(2)(inputs), keras.layers.Dense(1)(inputs)])
    model.compile(optimizer=k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss=["mse", "mse"])
    k3.make_private(model)
    pred = model(np.zeros((4, 4), "float32"))
    with pytest.raises(ValueError, match="y has 3 entries for the model's 2 outputs"):
        k3.per_example_loss(model, [np.zeros((4, 2))] * 3, pred)


def test_sanitized_gradients_refuses_a_reduced_loss():
    import tensorflow as tf

    model = _mlp()
    opt = k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    x, y = _data()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    with pytest.raises(ValueError, match="reduced over the batch"):
        k3.sanitized_gradients(opt, loss, model.trainable_variables, tape)


def test_a_custom_loop_with_a_poisson_rate_is_refused_unless_stated():
    """Issue 37.2: sanitized_gradients in a loop of one's own, with a known q: refused before any weight
    changes (the data are unseen); assume_poisson (the loop feeds lots at q) lets it run."""
    import tensorflow as tf

    model = _mlp()
    opt = k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.25, seed=1)
    x, y = _data()
    opt.build(model.trainable_variables)

    def step():  # a fresh tf.function: one whose trace raised is not traced again
        @tf.function
        def run(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2, axis=1)
            grads = k3.sanitized_gradients(opt, loss, model.trainable_variables, tape)
            opt.apply(grads, model.trainable_variables)

        return run

    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="custom training loop .* is refused"):
        step()(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assume_poisson(opt)
    step()(x, y)
    assert int(opt.noised_steps.numpy()) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-1.0), "noise_multiplier"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=1.5), "sampling_rate"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_lot_size=0), "expected_lot_size"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, seed=True), "seed"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, per_example_backend="x"), "per_example_backend"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_accumulation_steps=0), "gradient_accumulation_steps"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, loss_scale_factor=8.0), "loss_scale_factor"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        k3.DPSGDOptimizer(**kwargs)


@pytest.mark.parametrize(
    "cls",
    [k3.DPSGDOptimizer, k3.DPAdamOptimizer, tf_keras_optimizers.DPSGDOptimizer, tf_keras_optimizers.DPAdamOptimizer],
)
def test_num_microbatches_none_accepted_other_refused(cls):
    cls(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=None)
    with pytest.raises(ValueError, match="microbatch clipping"):
        cls(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=4)


def test_make_dp_optimizer_keras3():
    assert k3.make_dp_optimizer(keras.optimizers.SGD) is k3.DPSGDOptimizer
    rms = k3.make_dp_optimizer(keras.optimizers.RMSprop)
    assert rms.__name__ == "DPRMSpropOptimizer" and k3.make_dp_optimizer(keras.optimizers.RMSprop) is rms
    with pytest.raises(TypeError, match="Keras 3 optimizer class"):
        k3.make_dp_optimizer(tf_keras.optimizers.SGD)
    with pytest.raises(TypeError, match="already private"):
        k3.make_dp_optimizer(k3.DPAdamOptimizer)


def test_config_round_trip_and_registration():
    opt = k3.DPAdamOptimizer(
        l2_norm_clip=[1.0, 2.0], noise_multiplier=1.1, expected_lot_size=8, sampling_rate=0.01, seed=3
    )
    config = keras.optimizers.serialize(opt)
    assert config["registered_name"] == "keras_dpsgd>DPAdamOptimizer"
    again = keras.optimizers.deserialize(config)
    assert type(again) is k3.DPAdamOptimizer
    for key in (
        "l2_norm_clip",
        "noise_multiplier",
        "expected_lot_size",
        "sampling_rate",
        "seed",
        "per_example_backend",
    ):
        assert again.get_config()[key] == opt.get_config()[key]


def test_keras_file_keeps_noised_steps_and_loaded_model_must_be_made_private_again(tmp_path):
    model = k3.make_private(_mlp())
    model.compile(
        optimizer=assume_poisson(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5)),
        loss="mse",
    )
    model.fit(*_data(), batch_size=4, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is k3.DPSGDOptimizer
    assert int(loaded.optimizer.noised_steps.numpy()) == 2
    with pytest.raises(ValueError, match="make_private"):
        loaded.fit(*_data(), batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="is refused: the optimizer holds the Poisson sampling rate"):
        k3.make_private(loaded).fit(*_data(), batch_size=4, verbose=0)  # the statement is not saved
    assume_poisson(loaded.optimizer)
    loaded.fit(*_data(), batch_size=4, verbose=0)
    assert int(loaded.optimizer.noised_steps.numpy()) == 4


def test_model_epsilon_equals_the_accountant():
    q, sigma, steps = 0.25, 1.1, 6
    model = k3.make_private(_mlp())
    opt = assume_poisson(
        k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma, sampling_rate=q, expected_lot_size=2)
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(*_data(), batch_size=2, epochs=steps // 4, verbose=0)
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)
    assert int(opt.noised_steps.numpy()) == steps
    eps, delta = keras_dpsgd.model_epsilon(model, target_delta=1e-5)
    assert eps == pytest.approx(compute_epsilon(PoissonSampledGaussianEvent(q, sigma, count=steps), 1e-5), rel=1e-9)


def test_per_layer_effective_noise_multiplier():
    opt = k3.DPSGDOptimizer(l2_norm_clip=[1.0, 1.0, 1.0, 1.0], noise_multiplier=2.0)
    assert opt.effective_noise_multiplier == pytest.approx(1.0)
    by_name = k3.DPSGDOptimizer(l2_norm_clip={"net/d/kernel": 1.0}, noise_multiplier=1.0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False, name="d")], name="net")
    by_name.build(model.trainable_variables)
    np.testing.assert_array_equal(by_name.clip_bounds.numpy(), [1.0])


def test_poisson_lots_configure_and_fit_on_keras3():
    x, y = _data(40)
    lots = keras_dpsgd.PoissonLots(x, y, expected_lot_size=8, seed=0)
    opt = lots.configure(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0))
    assert opt.sampling_rate == pytest.approx(0.2) and opt.expected_lot_size == pytest.approx(8.0)
    model = k3.make_private(_mlp())
    model.compile(optimizer=opt, loss="mse")
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=1, verbose=0)
    assert int(opt.noised_steps.numpy()) == lots.steps_per_epoch
    eps, _ = keras_dpsgd.model_epsilon(model, target_delta=1e-5)
    event = PoissonSampledGaussianEvent(0.2, 1.0, count=lots.steps_per_epoch)
    assert eps == pytest.approx(compute_epsilon(event, 1e-5), rel=1e-9)


def test_explicit_submodules_and_the_tf_keras_factory_points_to_keras3():
    assert keras_dpsgd.keras3.DPSGDOptimizer is k3.DPSGDOptimizer
    assert keras_dpsgd.tf_keras.DPSGDOptimizer is tf_keras_optimizers.DPSGDOptimizer
    with pytest.raises(ValueError, match=r"keras_dpsgd\.keras3\.make_dp_optimizer"):
        tf_keras_optimizers.make_dp_optimizer(keras.optimizers.SGD)


def test_sanitize_refuses_other_variables_than_built():
    import tensorflow as tf

    model = _mlp()
    opt = k3.DPSGDOptimizer(l2_norm_clip=[1.0, 1.0], noise_multiplier=1.0)
    opt.build(model.trainable_variables)
    x, y = _data()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2, axis=1)
    with pytest.raises(ValueError, match="same order"):
        k3.sanitized_gradients(opt, loss, model.trainable_variables[::-1], tape)


def test_changing_sampling_rate_never_lowers_epsilon():
    """Steps taken at q = 0.5 stay charged at least at 0.5 after q changes (the ledger's bounds)."""
    from keras_dpsgd.accounting import PrivacyLedger

    model = k3.make_private(_mlp())
    opt = assume_poisson(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, sampling_rate=0.5))
    model.compile(optimizer=opt, loss="mse")
    model.fit(*_data(), batch_size=4, verbose=0)
    opt.sampling_rate = 0.05
    model.fit(*_data(), batch_size=4, verbose=0)
    eps, _ = keras_dpsgd.model_epsilon(model, target_delta=1e-5)
    truth = PrivacyLedger(
        [PoissonSampledGaussianEvent(0.5, 1.0, count=2), PoissonSampledGaussianEvent(0.05, 1.0, count=2)]
    )
    assert eps >= compute_epsilon(truth, 1e-5) * (1 - 1e-9)


def test_recompiling_with_a_new_dp_optimizer_keeps_the_first_fit_in_the_ledger(tmp_path):
    """Issue 12 hole 3(a) on Keras 3: the ledger is the model's, not the last optimizer's; a .keras
    file of the recompiled model carries the whole ledger (the optimizer's copy of its segments)."""
    first, second = (
        PoissonSampledGaussianEvent(0.25, 1.1, 4, "dp-sgd"),
        PoissonSampledGaussianEvent(0.5, 2.0, 2, "dp-sgd"),
    )
    model = k3.make_private(_mlp())
    model.compile(
        optimizer=assume_poisson(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, sampling_rate=0.25)),
        loss="mse",
    )
    model.fit(*_data(), batch_size=2, epochs=1, verbose=0)  # 4 steps, no callback, no ledger read
    model.compile(
        optimizer=assume_poisson(k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=2.0, sampling_rate=0.5)),
        loss="mse",
    )
    model.save(tmp_path / "recompiled.keras")  # before the new optimizer's first step
    model.fit(*_data(), batch_size=4, epochs=1, verbose=0)  # 2 more steps
    eps, _ = keras_dpsgd.model_epsilon(model, target_delta=1e-5)
    assert eps == pytest.approx(compute_epsilon([first, second], 1e-5), rel=1e-9)
    model.save(tmp_path / "m.keras")

    def events(path):
        return keras_dpsgd.model_privacy_ledger(keras.models.load_model(path)).events

    assert events(tmp_path / "recompiled.keras") == (first,)
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert keras_dpsgd.model_privacy_ledger(loaded).events == (first, second)
    assert keras_dpsgd.model_epsilon(loaded, target_delta=1e-5)[0] == pytest.approx(eps, rel=1e-12)
    assume_poisson(k3.make_private(loaded).optimizer)  # the statement is not saved
    loaded.fit(*_data(), batch_size=4, epochs=1, verbose=0)  # resumed: 2 more steps
    assert keras_dpsgd.model_privacy_ledger(loaded).events == (
        first,
        PoissonSampledGaussianEvent(0.5, 2.0, 4, "dp-sgd"),
    )


def _with_preprocessing(layer):
    model = k3.make_private(keras.Sequential([keras.Input((4,)), layer, keras.layers.Dense(1)]))
    model.compile(optimizer=k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse")
    return model


def test_adapted_normalization_is_refused_on_keras3_and_public_ones_train():
    """Issue 12 hole 5(a) on Keras 3: statistics adapted on the data would ship outside the ledger."""
    x, y = _data()
    adapted = keras.layers.Normalization()
    adapted.adapt(x)
    with pytest.raises(ValueError, match="fitted on data"):
        _with_preprocessing(adapted).fit(x, y, batch_size=4, epochs=1, verbose=0)
    given = keras.layers.Normalization(mean=np.zeros(4), variance=np.ones(4))
    _with_preprocessing(given).fit(x, y, batch_size=4, epochs=1, verbose=0)
    marked = keras.layers.Normalization()
    marked.adapt(x)
    _with_preprocessing(keras_dpsgd.mark_public(marked)).fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_adapted_discretization_is_refused_on_keras3():
    x, y = _data()
    adapted = keras.layers.Discretization(num_bins=3)
    adapted.adapt(x)
    with pytest.raises(ValueError, match="bin boundaries"):
        k3.refuse_adapted_preprocessing(keras.Sequential([keras.Input((4,)), adapted]))
    k3.refuse_adapted_preprocessing(keras.Sequential([keras.Input((4,)), keras.layers.Discretization([0.0, 0.5])]))
