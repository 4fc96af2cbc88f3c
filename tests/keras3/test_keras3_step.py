"""Keras 3: the private train step against a one-example-at-a-time loop (σ = 0), and its noise."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dpsgd.keras3 as k3
from tests._keras3_helpers import loop_clipped_mean, one_sgd_step

LR = 0.5


def _dense(rng):
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)]
    ), rng.normal(size=(7, 5)).astype("float32")


def _conv(rng):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    return model, rng.normal(size=(5, 6, 6, 2)).astype("float32")


def _embedding(rng):
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(10, 4)(inputs)
    h = keras.layers.LayerNormalization()(h)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(h))
    return keras.Model(inputs, outputs), rng.integers(0, 10, size=(6, 4)).astype("int32")


MODELS = {"conv2d": _conv, "embedding_layernorm": _embedding}


def _compiled(factory, clip, backend="auto", noise=0.0, seed=0, **kwargs):
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    model, x = factory(rng)
    y = rng.integers(0, 3, size=len(x))
    opt = k3.DPSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=noise, learning_rate=LR, per_example_backend=backend, seed=1, **kwargs
    )
    k3.make_private(model)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, x, y


def _assert_fit_step(model, x, y, expected, batch_size):
    """One epoch of fit in batches of `batch_size` (unshuffled) moves the weights by LR · `expected`."""
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    after = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


def _assert_step(model, x, y, clip, per_layer, sample_weight=None):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    expected = loop_clipped_mean(model, x, y, loss_fn, clip, per_layer, sample_weight)
    before, after = one_sgd_step(model, x, y, LR, sample_weight)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


# The checks shared with tf_keras (every model, flat and per-layer, batch 1, noise, empty lots,
# accumulation, the ledger) are in tests/test_behaviour.py; here the Keras 3 step's own.
@pytest.mark.parametrize("name, backend", [("conv2d", "reference"), ("embedding_layernorm", "reference")])
def test_reference_backend_step_matches_loop(name, backend):
    model, x, y = _compiled(MODELS[name], 0.3, backend)
    _assert_step(model, x, y, 0.3, per_layer=False)


def test_sample_weights_weight_the_per_example_loss():
    model, x, y = _compiled(_dense, 0.3)
    weights = np.linspace(0.0, 2.0, len(x)).astype("float32")
    _assert_step(model, x, y, 0.3, per_layer=False, sample_weight=weights)


def test_loss_by_name_and_function():
    for loss in ("mse", keras.losses.mean_squared_error):
        rng = np.random.default_rng(2)
        model, x = _dense(rng)
        y = rng.normal(size=(len(x), 3)).astype("float32")
        model.compile(optimizer=k3.DPSGDOptimizer(l2_norm_clip=0.4, noise_multiplier=0.0, learning_rate=LR), loss=loss)
        k3.make_private(model)
        expected = loop_clipped_mean(model, x, y, keras.losses.mean_squared_error, 0.4)
        before, after = one_sgd_step(model, x, y, LR)
        for b, a, g in zip(before, after, expected):
            np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)


# Weight regularizers and the add_loss refusal: tests/test_behaviour.py (both Kerases).


def test_per_layer_noise_std_is_sigma_c_over_lot():
    per_layer = True
    """Zero gradients (targets = predictions): the update is N(0, (σC/L)²) per coordinate."""
    sigma, clip, lot = 1.3, 0.7, 4.0
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((40,)), keras.layers.Dense(250, use_bias=False)])
    x = np.random.default_rng(0).normal(size=(8, 40)).astype("float32")
    y = model.predict(x, verbose=0)
    bounds = [clip] if per_layer else clip
    opt = k3.DPSGDOptimizer(l2_norm_clip=bounds, noise_multiplier=sigma, learning_rate=1.0, expected_lot_size=lot)
    model.compile(optimizer=opt, loss="mse")
    k3.make_private(model)
    before, after = one_sgd_step(model, x, y, 1.0)
    noise = (before[0] - after[0]).ravel()
    expected = sigma * clip / lot
    # 10,000 coordinates: the sample std is within 3% of σC/L with probability > 0.9999 (chi-square).
    assert abs(noise.std() / expected - 1.0) < 0.03
    assert abs(noise.mean()) < 4 * expected / np.sqrt(noise.size)
    assert int(opt.noised_steps.numpy()) == 1


def test_seeded_noise_is_reproducible_and_fresh_per_step():
    def run():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
        x = np.ones((2, 3), "float32")
        model.compile(optimizer=k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, seed=7), loss="mse")
        k3.make_private(model)
        y = model.predict(x, verbose=0)
        first = one_sgd_step(model, x, y, 1.0)
        second = one_sgd_step(model, x, y, 1.0)
        return first[0][0] - first[1][0], second[0][0] - second[1][0]

    a, b = run(), run()
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.allclose(a[0], a[1])


def test_nonfinite_examples_are_zeroed_and_counted():
    model, x, y = _compiled(_dense, 0.3)
    x = x.copy()
    x[2, 0] = np.nan
    before, after = one_sgd_step(model, x, y, LR)
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1
    assert all(np.all(np.isfinite(a)) for a in after)
    # An un-noised count over the private data: never among the saved optimizer variables.
    assert not any("nonfinite" in v.name for v in model.optimizer.variables)


class OwnStep(keras.Model):
    """A model with its own train_step: `update(optimizer, per_example_loss, variables, tape)`."""

    def __init__(self, update):
        super().__init__()
        self.dense = keras.layers.Dense(3)
        self.update = update

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, self(x, training=True), from_logits=True)
        self.update(self.optimizer, loss, self.trainable_variables, tape)
        return {"loss": tf.reduce_mean(loss)}


def _sanitize_then_apply(optimizer, loss, variables, tape):
    optimizer.apply(k3.sanitized_gradients(optimizer, loss, variables, tape), variables)


def test_custom_train_step_with_sanitized_gradients():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 4)).astype("float32")
    y = rng.integers(0, 3, size=5)
    model = OwnStep(_sanitize_then_apply)
    model(x[:1])
    model.compile(optimizer=k3.DPSGDOptimizer(l2_norm_clip=0.2, noise_multiplier=0.0, learning_rate=LR))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    expected = loop_clipped_mean(model, x, y, loss_fn, 0.2)
    before, after = one_sgd_step(model, x, y, LR)
    for b, a, g in zip(before, after, expected):
        np.testing.assert_allclose((b - a) / LR, g, rtol=2e-4, atol=2e-6)
    with pytest.raises(ValueError, match="private_update"):
        k3.make_private(model)


def test_jit_compiled_step_matches_loop():
    model, x, y = _compiled(_conv, 0.3)
    model.compile(optimizer=model.optimizer, loss=model.loss, jit_compile=True)
    _assert_step(model, x, y, 0.3, per_layer=False)
    assert model.jit_compile


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "mixed_float16_unscaled"])
def test_mixed_precision(policy):
    """bfloat16 trains; float16 loss scaling (a LossScaleOptimizer) is refused; float16 without it trains."""
    keras.mixed_precision.set_global_policy(policy.replace("_unscaled", ""))
    try:
        model = k3.make_private(keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)]))
        model.compile(
            optimizer=k3.DPSGDOptimizer(l2_norm_clip=0.3, noise_multiplier=1.0),
            loss="mse",
            auto_scale_loss=policy != "mixed_float16_unscaled",
        )
        x, y = np.ones((8, 2), "float32"), np.zeros((8, 3), "float32")
        if policy == "mixed_float16":
            with pytest.raises(ValueError, match="LossScaleOptimizer"):
                model.fit(x, y, batch_size=4, verbose=0)
            return
        model.fit(x, y, batch_size=4, verbose=0)
        assert int(model.optimizer.noised_steps.numpy()) == 2
        assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_logged_loss_and_metrics_are_those_of_keras():
    """The step logs the compiled loss (and metrics) at the weights before the update, as Keras does."""
    model, x, y = _compiled(_dense, 0.3)
    model.compile(optimizer=model.optimizer, loss=model.loss, metrics=["sparse_categorical_accuracy"])
    expected = model.evaluate(x, y, batch_size=len(x), verbose=0, return_dict=True)
    history = model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0).history
    assert history["loss"][0] == pytest.approx(expected["loss"], rel=1e-5)
    assert history["sparse_categorical_accuracy"][0] == pytest.approx(expected["sparse_categorical_accuracy"])


def test_all_zero_weights_lot_moves_nothing_without_noise():
    """An empty Poisson lot (every padded example weighted 0) adds 0 before the noise."""
    model, x, y = _compiled(_dense, 0.3, expected_lot_size=4.0)
    before, after = one_sgd_step(model, x, y, LR, sample_weight=np.zeros(len(x), "float32"))
    for b, a in zip(before, after):
        np.testing.assert_array_equal(b, a)
    assert int(model.optimizer.noised_steps.numpy()) == 1


def test_multi_output_loss_is_the_weighted_sum_per_example():
    """Two outputs, a dict of losses and loss_weights: ℓ_i = 0.3·CE_i + 2·MSE_i, step against the loop."""
    rng = np.random.default_rng(6)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="tanh")(inputs)
    model = keras.Model(inputs, {"cls": keras.layers.Dense(3)(hidden), "reg": keras.layers.Dense(2)(hidden)})
    x = rng.normal(size=(6, 4)).astype("float32")
    y = {"cls": rng.integers(0, 3, size=6), "reg": rng.normal(size=(6, 2)).astype("float32")}
    k3.make_private(model)
    model.compile(
        optimizer=k3.DPSGDOptimizer(l2_norm_clip=0.4, noise_multiplier=0.0, learning_rate=LR),
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        loss_weights={"cls": 0.3, "reg": 2.0},
    )
    pred = model(x)
    logits = pred["cls"].numpy().astype(np.float64)
    log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    by_hand = -0.3 * log_softmax[np.arange(6), y["cls"]] + 2.0 * ((y["reg"] - pred["reg"].numpy()) ** 2).mean(axis=1)
    np.testing.assert_allclose(k3.per_example_loss(model, y, pred).numpy(), by_hand, rtol=1e-5)

    def loss_fn(y_i, pred_i):
        return k3.per_example_loss(model, y_i, pred_i)

    _assert_fit_step(model, x, y, loop_clipped_mean(model, x, y, loss_fn, 0.4), batch_size=len(x))


def test_masked_loss_is_the_mean_over_each_examples_unmasked_steps():
    """Embedding(mask_zero=True) + return_sequences: ℓ_i = mean of CE over example i's tokens that are not 0."""
    rng = np.random.default_rng(7)
    model = keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(8, 3, mask_zero=True),
            keras.layers.SimpleRNN(4, return_sequences=True),
            keras.layers.Dense(3),
        ]
    )
    x = rng.integers(1, 8, size=(4, 5)).astype("int32")
    x[0, 2:] = 0  # 2 tokens
    x[1, 4:] = 0  # 4 tokens
    y = rng.integers(0, 3, size=(4, 5))
    k3.make_private(model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=k3.DPSGDOptimizer(l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=LR), loss=loss)
    pred = model(x)
    logits = pred.numpy().astype(np.float64)
    ce = -(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[np.arange(4)[:, None], np.arange(5), y]
    mask = x != 0
    by_hand = (ce * mask).sum(1) / mask.sum(1)
    np.testing.assert_allclose(k3.per_example_loss(model, y, pred).numpy(), by_hand, rtol=1e-5)
    # The oracle: Keras's own masked loss of one example (its unmasked steps' mean), one at a time.
    _assert_fit_step(model, x, y, loop_clipped_mean(model, x, y, loss, 0.5), batch_size=len(x))


def test_custom_train_step_accumulates_with_private_update():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(6, 4)).astype("float32")
    y = rng.integers(0, 3, size=6)
    model = OwnStep(k3.private_update)
    model(x[:1])
    opt = k3.DPSGDOptimizer(l2_norm_clip=0.2, noise_multiplier=0.0, learning_rate=LR, gradient_accumulation_steps=3)
    model.compile(optimizer=opt)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    expected = loop_clipped_mean(model, x, y, loss_fn, 0.2)
    _assert_fit_step(model, x, y, expected, batch_size=2)
    assert int(opt.noised_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 1
    with pytest.raises(ValueError, match="private_update"):
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        k3.sanitized_gradients(opt, loss, model.trainable_variables, tape)


def test_keras_own_gradient_accumulation_is_refused():
    class Raw(k3.DPKeras3Mixin, keras.optimizers.SGD):
        def __init__(self, **kwargs):
            keras.optimizers.SGD.__init__(self, gradient_accumulation_steps=2)

    with pytest.raises(ValueError, match="separately noised"):
        Raw()


def test_jit_compiled_accumulated_lot_matches_loop():
    """jit_compile=True with k = 2: the lot's release (a tf.cond around noise and apply) compiles with XLA."""
    model, x, y = _compiled(_dense, 0.3, gradient_accumulation_steps=2)
    x, y = np.concatenate([x, x[:1]]), np.concatenate([y, y[:1]])  # 8 examples: 2 batches of 4
    model.compile(optimizer=model.optimizer, loss=model.loss, jit_compile=True)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    expected = loop_clipped_mean(model, x, y, loss_fn, 0.3)
    _assert_fit_step(model, x, y, expected, batch_size=4)
    assert int(model.optimizer.noised_steps.numpy()) == 1 and model.jit_compile


def test_a_keras_file_saved_mid_lot_loads_no_partial_lot(tmp_path):
    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt

    model, x, y = _compiled(_dense, 0.3, gradient_accumulation_steps=2)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[Interrupt()])
    assert int(model.optimizer._accum_batches.numpy()) == 1
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.gradient_accumulation_steps == 2
    assert int(loaded.optimizer._accum_batches.numpy()) == 0
    assert all(not np.any(a.numpy()) for a in loaded.optimizer._accumulators)
    assert loaded.optimizer.discarded_lots == 1


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: k3.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=LR),
        lambda: k3.DPAdamOptimizer(l2_norm_clip=[1.0] * 4, noise_multiplier=1.1, gradient_accumulation_steps=2),
        lambda: k3.AdaptiveDPSGDOptimizer([1.0] * 4, 1.1, 1.0, learning_rate=LR),
    ],
    ids=["sgd", "adam-per-layer-accumulated", "adaptive"],
)
def test_the_private_step_is_traced_once(make_optimizer):
    """``fit`` traces the DP train step once, as Keras's own step: the DP optimizer and the model's copy of the
    ledger are built before the trace (variables made in the first trace made ``tf.function`` trace the whole
    step a second time)."""
    model, x = _dense(np.random.default_rng(0))
    k3.make_private(model)
    model.compile(optimizer=make_optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    traces = []
    step = model.train_step

    def counted(data):
        traces.append(1)
        return step(data)

    model.train_step = counted
    model.fit(x, np.arange(7) % 3, batch_size=4, epochs=1, verbose=0)
    assert len(traces) == 1
