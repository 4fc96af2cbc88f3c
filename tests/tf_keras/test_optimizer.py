"""DPSGDOptimizer steps against a one-example-at-a-time loop (Abadi et al. 2016, Alg. 1)."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.tf_keras import DPAdamOptimizer, DPSGDOptimizer

LR = 0.5


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(5, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs, training=False):
        return self.out(self.hidden(inputs) * 2.0)


def _model(kind):
    keras.utils.set_random_seed(3)
    if kind == "dense":
        return keras.Sequential([keras.layers.Dense(6, activation="relu", input_shape=(4,)), keras.layers.Dense(3)])
    if kind == "conv":
        return keras.Sequential(
            [
                keras.layers.Conv2D(2, 3, activation="relu", input_shape=(5, 5, 1)),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
    if kind == "embedding":
        return keras.Sequential(
            [keras.layers.Embedding(10, 4, input_length=3), keras.layers.Flatten(), keras.layers.Dense(3)]
        )
    if kind == "layernorm":
        inputs = keras.Input((4,))
        hidden = keras.layers.LayerNormalization()(keras.layers.Dense(6)(inputs))
        return keras.Model(inputs, keras.layers.Dense(3)(hidden))
    if kind == "rnn":
        return keras.Sequential([keras.layers.SimpleRNN(4, unroll=True, input_shape=(3, 2)), keras.layers.Dense(3)])
    if kind == "subclassed":
        model = _Subclassed()
        model(np.zeros((1, 4), "float32"))
        return model
    raise ValueError(kind)


def _data(kind, batch, seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"conv": (5, 5, 1), "rnn": (3, 2)}
    if kind == "embedding":
        x = rng.integers(0, 10, size=(batch, 3))
    else:
        x = rng.normal(size=(batch,) + shapes.get(kind, (4,))).astype("float32") * 3.0
    return x, rng.integers(0, 3, size=batch)


def _clip(grads, clip):
    """clip(g): flat (float) or per variable (list)."""
    if isinstance(clip, list):
        return [g * min(1.0, c / max(np.linalg.norm(g), 1e-30)) for g, c in zip(grads, clip)]
    norm = np.sqrt(sum(np.sum(g**2) for g in grads))
    return [g * min(1.0, clip / max(norm, 1e-30)) for g in grads]


def _expected_step(kind, x, y, clip, lr=LR):
    """w - lr · (1/B) Σ_i clip(g_i), one example at a time."""
    model = _model(kind)
    total = None
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            loss = _loss()(y[i : i + 1], model(x[i : i + 1], training=True))[0]
        grads = [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(loss, model.trainable_variables)]
        grads = _clip(grads, clip)
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [w.numpy() - lr * g / len(y) for w, g in zip(model.trainable_variables, total)]


def _dp_step(kind, x, y, clip, noise=0.0, **compile_kwargs):
    model = _model(kind)
    opt = DPSGDOptimizer(clip, noise, learning_rate=LR, per_example_backend="reference")
    model.compile(optimizer=opt, loss=_loss(), **compile_kwargs)
    model.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_variables], opt


def _assert_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind", ["dense", "conv", "embedding", "layernorm", "rnn", "subclassed"])
def test_flat_clipping_matches_loop(kind):
    x, y = _data(kind, 6)
    actual, opt = _dp_step(kind, x, y, 0.3)
    _assert_close(actual, _expected_step(kind, x, y, 0.3))
    assert int(opt.noised_steps.numpy()) == 1
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("kind", ["dense", "conv"])
def test_per_layer_clipping_matches_loop(kind):
    x, y = _data(kind, 5)
    num_vars = len(_model(kind).trainable_variables)
    clip = [0.05 * (v + 1) for v in range(num_vars)]
    actual, opt = _dp_step(kind, x, y, clip)
    _assert_close(actual, _expected_step(kind, x, y, clip))
    np.testing.assert_allclose(opt.clip_bounds.numpy(), clip, rtol=1e-6)


def test_per_layer_clipping_by_name():
    x, y = _data("dense", 4)
    model = _model("dense")
    bounds = [0.1 * (i + 1) for i in range(len(model.trainable_variables))]
    clip = {v.name[:-2]: c for v, c in zip(model.trainable_variables, bounds)}
    model.compile(optimizer=DPSGDOptimizer(clip, 0.0, learning_rate=LR), loss=_loss())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_close([w.numpy() for w in model.trainable_variables], _expected_step("dense", x, y, bounds))


def test_per_layer_clipping_mismatch_errors():
    x, y = _data("dense", 4)
    with pytest.raises(ValueError, match="one bound per trainable variable"):
        _dp_step("dense", x, y, [1.0, 1.0])
    with pytest.raises(ValueError, match="no bound for trainable variable"):
        _dp_step("dense", x, y, {"dense/kernel": 1.0})


def test_batch_size_one():
    x, y = _data("dense", 1)
    actual, _ = _dp_step("dense", x, y, 0.2)
    _assert_close(actual, _expected_step("dense", x, y, 0.2))


def test_xla():
    x, y = _data("dense", 4)
    actual, _ = _dp_step("dense", x, y, 0.3, jit_compile=True)
    _assert_close(actual, _expected_step("dense", x, y, 0.3))


def test_huge_clip_zero_noise_is_non_private_step():
    x, y = _data("dense", 6)
    model = _model("dense")
    model.compile(
        optimizer=keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    actual, _ = _dp_step("dense", x, y, 1e9)
    _assert_close(actual, [w.numpy() for w in model.trainable_variables])


def test_accumulation_equals_one_big_lot():
    x, y = _data("dense", 12)
    big, _ = _dp_step("dense", x, y, 0.3)
    model = _model("dense")
    opt = DPSGDOptimizer(0.3, 0.0, learning_rate=LR, gradient_accumulation_steps=3)
    model.compile(optimizer=opt, loss=_loss())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_close([w.numpy() for w in model.trainable_variables], big)
    assert int(opt.noised_steps.numpy()) == 1
    assert int(opt.iterations.numpy()) == 1
    # Two batches of the next lot: no update, no noise yet.
    before = [w.numpy() for w in model.trainable_variables]
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, shuffle=False, verbose=0)
    _assert_close([w.numpy() for w in model.trainable_variables], before)
    assert int(opt.noised_steps.numpy()) == 1


def test_expected_lot_size_normalizes():
    x, y = _data("dense", 4)
    model = _model("dense")
    opt = DPSGDOptimizer(0.3, 0.0, learning_rate=LR, expected_lot_size=8)
    model.compile(optimizer=opt, loss=_loss())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    # Dividing by 8 instead of 4 halves the step.
    _assert_close([w.numpy() for w in model.trainable_variables], _expected_step("dense", x, y, 0.3, lr=LR / 2))


def test_scalar_loss_error_says_how_to_fix():
    x, y = _data("dense", 4)
    model = _model("dense")
    model.compile(optimizer=DPSGDOptimizer(1.0, 1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match='reduction="none"'):
        model.fit(x, y, batch_size=4, verbose=0)


def test_batch_normalization_refused():
    model = keras.Sequential(
        [keras.layers.Dense(4, input_shape=(4,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)]
    )
    model.compile(optimizer=DPSGDOptimizer(1.0, 1.0), loss=_loss())
    x, y = _data("dense", 4)
    with pytest.raises(ValueError, match="GroupNormalization"):
        model.fit(x, y, batch_size=4, verbose=0)


def test_raw_apply_gradients_refused():
    model = _model("dense")
    opt = DPSGDOptimizer(1.0, 1.0)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="non-private step"):
        opt.apply_gradients(zip(grads, model.trainable_variables))


def test_nonfinite_example_is_zeroed_and_counted():
    x, y = _data("dense", 5)
    x_bad = x.copy()
    x_bad[2, 0] = np.nan
    model = _model("dense")
    opt = DPSGDOptimizer(0.3, 0.0, learning_rate=LR, expected_lot_size=5)
    model.compile(optimizer=opt, loss=_loss())
    model.fit(x_bad, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    keep = [0, 1, 3, 4]
    # The four finite examples, still divided by the lot size 5.
    expected = _expected_step("dense", x[keep], y[keep], 0.3, lr=LR * 4 / 5)
    _assert_close([w.numpy() for w in model.trainable_variables], expected)
    assert int(opt.nonfinite_examples.numpy()) == 1


def test_regularization_pair_is_not_clipped():
    """A (per_example_loss, regularization_loss) pair: ∇R is added after clipping."""
    x, y = _data("dense", 4)
    model = _model("dense")
    opt = DPSGDOptimizer(0.3, 0.0, learning_rate=LR)
    opt.build(model.trainable_variables)
    kernel = model.trainable_variables[0]

    @tf.function  # A DP step is traced (an eager one is refused), with the batch as its arguments.
    def gradients(x, y):
        with tf.GradientTape(persistent=True) as tape:
            per_example = _loss()(y, model(x, training=True))
            reg = 10.0 * tf.reduce_sum(tf.square(kernel))
        return opt.compute_gradients((per_example, reg), model.trainable_variables, tape)

    grads = gradients(x, y)
    reference = _expected_step("dense", x, y, 0.3, lr=1.0)
    w0 = [w.numpy() for w in _model("dense").trainable_variables]
    expected = [w - r for w, r in zip(w0, reference)]  # (1/B) Σ clip(g_i)
    expected[0] = expected[0] + 20.0 * w0[0]
    _assert_close([g.numpy() for g, _ in grads], expected)
    with tf.GradientTape() as tape:
        per_example = _loss()(y, model(x, training=True))
        reg = tf.reduce_sum(kernel)
    with pytest.raises(ValueError, match="persistent=True"):
        opt.compute_gradients((per_example, reg), model.trainable_variables, tape)


def test_adam_is_post_processing():
    """DPAdam's update equals Adam applied to the DP-SGD sanitized gradient."""
    x, y = _data("dense", 6)
    model = _model("dense")
    model.compile(optimizer=DPAdamOptimizer(0.3, 0.0, learning_rate=0.01), loss=_loss())
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    sanitized = [
        (w0 - w) / LR
        for w0, w in zip([w.numpy() for w in _model("dense").trainable_variables], _expected_step("dense", x, y, 0.3))
    ]
    reference = _model("dense")
    adam = keras.optimizers.Adam(learning_rate=0.01)
    adam.apply_gradients(zip([tf.constant(g) for g in sanitized], reference.trainable_variables))
    _assert_close([w.numpy() for w in model.trainable_variables], [w.numpy() for w in reference.trainable_variables])


def test_a_custom_loop_with_a_poisson_rate_is_refused_unless_stated():
    """Issue 37.2: a custom loop's data are unseen: with a known q the step is refused before any weight
    changes; assume_poisson (the loop feeds lots at q) lets it run."""
    from keras_dpsgd.ledger import assume_poisson

    model = _model("dense")
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=LR, sampling_rate=0.25, seed=1)
    x, y = np.ones((4, 4), "float32"), np.arange(4) % 3

    def step():  # a fresh tf.function: one whose trace raised is not traced again
        @tf.function
        def run(x, y):
            with tf.GradientTape() as tape:
                loss = _loss()(y, model(x, training=True))
            opt.minimize(loss, model.trainable_variables, tape=tape)

        return run

    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="custom training loop .* is refused"):
        step()(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assume_poisson(opt)
    step()(x, y)
    assert int(opt.noised_steps.numpy()) == 1


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: DPSGDOptimizer(1.0, 1.1, learning_rate=LR),
        lambda: DPAdamOptimizer([1.0] * 4, 1.1, gradient_accumulation_steps=2),
        lambda: __import__("keras_dpsgd.tf_keras", fromlist=["x"]).AdaptiveDPSGDOptimizer([1.0] * 4, 1.1, 1.0),
    ],
    ids=["sgd", "adam-per-layer-accumulated", "adaptive"],
)
def test_the_private_step_is_traced_once(make_optimizer):
    """``fit`` traces the DP step once: the DP optimizer and the model's copy of the ledger are built before the
    trace (``keras_dpsgd.step.prebuild``; variables made in the first trace made ``tf.function`` trace it again)."""
    model = _model("dense")
    model.compile(optimizer=make_optimizer(), loss=_loss())
    x, y = _data("dense", 8)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.train_tf_function.experimental_get_tracing_count() == 1
    assert int(model.optimizer.noised_steps.numpy()) == (1 if model.optimizer.gradient_accumulation_steps == 2 else 2)


def test_a_model_with_its_own_train_step_is_left_to_tf_keras():
    """A train_step of the model's own class may train other variables: its optimizer is built by tf_keras, in
    the trace, from the variables that step passes (traced twice, as tf_keras does for every optimizer)."""

    class Own(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compiled_loss(y, self(x, training=True))
            self.optimizer.minimize(loss, self.trainable_variables[2:], tape=tape)  # the last layer only
            return {"loss": tf.reduce_mean(loss)}

    keras.utils.set_random_seed(3)
    model = Own([keras.layers.Dense(6, activation="relu", input_shape=(4,)), keras.layers.Dense(3)])
    model.compile(optimizer=DPSGDOptimizer(1.0, 0.0, learning_rate=LR), loss=_loss())
    first = model.layers[0].kernel.numpy()
    x, y = _data("dense", 4)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), first)
    assert int(model.optimizer.noised_steps.numpy()) == 1
