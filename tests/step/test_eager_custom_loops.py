"""Issue 40, item 6: TF Privacy's custom loops called eagerly (``minimize(loss_fn, var_list)``,
``compute_gradients(loss_fn, var_list)``; ``sanitize`` on Keras 3), outside any tf.function.

The optimizer traces the loss callable itself, so the graph checks run on it: closed forms (zero noise and a large
bound give the mean gradient; the clipped mean its formula; the noise's standard deviation σC/B at 5 sigma), and
what the checks reject stays refused, before any update. On tf_keras and Keras 3 with TensorFlow. These steps were
all refused as eager before (the eager refusal of the per-example backend).
"""

import numpy as np
import pytest
import tensorflow as tf

from tests._behaviour import keras3_front, tf_keras_front

FRONTS = {"keras3": keras3_front, "tf_keras": tf_keras_front}
DATA = np.array([[3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [-9.0, 0.0]], np.float32)  # TF Privacy's test data
START = np.array([1.0, 2.0], np.float32)
STATS = tf.constant([1.0, 2.0, 3.0])  # an eager tensor of another shape than the batch, captured by a loss


@pytest.fixture(scope="module", params=sorted(FRONTS))
def front(request):
    return FRONTS[request.param]()


def _variable(front, value):
    return front.keras.Variable(value) if front.name == "keras3" else tf.Variable(value)


def _read(var):
    return tf.convert_to_tensor(var.value if hasattr(var, "path") else var)


def _loss(var, data):
    """TF Privacy's per-example loss: 0.5 ||var - x_i||², gradient var - x_i."""
    return lambda: 0.5 * tf.reduce_sum(tf.math.squared_difference(_read(var), data), axis=1)


def _gradients(front, opt, loss, var):
    """compute_gradients (tf_keras) or sanitize (Keras 3), called eagerly with the loss callable."""
    if front.name == "keras3":
        return [g.numpy() for g in opt.sanitize(loss, [var])]
    return [g.numpy() for g, _ in opt.compute_gradients(loss, [var])]


def _opt(front, clip, sigma, **kwargs):
    return front.optimizer_cls(l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=2.0, **kwargs)


@pytest.mark.parametrize("held", ["tensor", "variable"])
def test_zero_noise_and_a_large_bound_give_the_mean_gradient(front, held):
    """σ = 0, C = 1e6: the mean of var - x_i; data as a captured tensor or, as TF Privacy's tests, a variable."""
    var = _variable(front, START)
    data = tf.constant(DATA) if held == "tensor" else tf.Variable(DATA)
    opt = _opt(front, 1e6, 0.0)
    (grad,) = _gradients(front, opt, _loss(var, data), var)
    np.testing.assert_allclose(grad, START - DATA.mean(axis=0), rtol=1e-6)
    assert tf.executing_eagerly() and int(opt.noised_steps.numpy()) == 1


def test_the_clipped_mean_is_its_formula(front):
    """C = 1: (1/B) Σ_i g_i min(1, C/||g_i||)."""
    var = _variable(front, START)
    g = START - DATA
    expected = (g * np.minimum(1.0, 1.0 / np.linalg.norm(g, axis=1, keepdims=True))).mean(axis=0)
    (grad,) = _gradients(front, _opt(front, 1.0, 0.0), _loss(var, tf.constant(DATA)), var)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)


def test_minimize_applies_the_clipped_mean(front, caplog):
    """minimize(loss_fn, var_list) eagerly: var - lr · mean(clip(g_i)), twice (a trace per call, announced once)."""
    var = _variable(front, START)
    opt = _opt(front, 1e6, 0.0)
    loss = _loss(var, tf.constant(DATA))
    opt.minimize(loss, [var])
    np.testing.assert_allclose(np.array(_read(var)), START - 2.0 * (START - DATA.mean(axis=0)), rtol=1e-6)
    opt.minimize(loss, [var])  # back to START: var' = var - 2 (var - mean) = 2 mean - var
    np.testing.assert_allclose(np.array(_read(var)), START, rtol=1e-5)
    assert int(opt.noised_steps.numpy()) == 2
    assert caplog.text.count("called eagerly with a loss callable") == 1


def test_the_noise_has_standard_deviation_sigma_c_over_b(front):
    """Gradients 0 (var = x_i = 0), σ = 2, C = 0.5, B = 4: each coordinate N(0, (σC/B)²), 4000 of them."""
    d, b, sigma, clip = 4000, 4, 2.0, 0.5
    var = _variable(front, np.zeros(d, np.float32))
    opt = _opt(front, clip, sigma, seed=3)
    (noise,) = _gradients(front, opt, _loss(var, tf.zeros((b, d))), var)
    std = sigma * clip / b
    assert abs(noise.mean()) < 5 * std / np.sqrt(d)
    assert abs(noise.std() / std - 1) < 5 / np.sqrt(2 * d)


@pytest.mark.parametrize(
    "loss, message",
    [
        (
            lambda v, x: lambda: tf.reduce_mean(tf.math.squared_difference(_read(v), x)),
            r"reduced over the batch|per-example loss of rank 1",
        ),
        (
            lambda v, x: lambda: tf.reduce_sum(tf.math.squared_difference(_read(v), x - tf.reduce_mean(x, 0)), 1),
            r"mixes the examples of the batch",
        ),
        (
            lambda v, x: lambda: tf.reduce_sum(tf.math.squared_difference(_read(v), x - STATS[:2]), 1),
            r"reads a captured tensor of shape \(3,\), whose first dimension is not the loss.s 4",
        ),
    ],
    ids=["scalar", "batch-mean", "another-shape"],
)
def test_what_the_graph_check_rejects_stays_refused(front, loss, message):
    """A scalar loss, a batch statistic, a captured tensor that is not of the batch's rows: refused, no update."""
    var = _variable(front, START)
    opt = _opt(front, 1.0, 0.0)
    with pytest.raises(ValueError, match=message):
        opt.minimize(loss(var, tf.constant(DATA)), [var])
    np.testing.assert_array_equal(np.array(_read(var)), START)
    assert int(opt.noised_steps.numpy()) == 0


def test_a_poisson_rate_still_needs_assume_poisson(front):
    """Issue 37: a custom loop of an optimizer holding a Poisson rate is refused unless assume_poisson says so."""
    from keras_dpsgd.ledger import assume_poisson

    var = _variable(front, START)
    opt = _opt(front, 1e6, 0.0, sampling_rate=0.25)
    loss = _loss(var, tf.constant(DATA))
    with pytest.raises(ValueError, match=r"custom training loop of a DP optimizer that holds a Poisson sampling rate"):
        opt.minimize(loss, [var])
    assert int(opt.noised_steps.numpy()) == 0
    assume_poisson(opt)
    opt.minimize(loss, [var])
    assert int(opt.noised_steps.numpy()) == 1


def test_a_keras_model_on_numpy_arrays_gives_the_one_example_at_a_time_clipped_mean(front):
    """TF Privacy's loop with a model: loss_fn = lambda: loss(y, model(x)), x and y numpy arrays (constants of the
    trace): the gradients equal (1/B) Σ_i clip(∇ℓ_i) computed one example at a time."""
    K = front.keras
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 2, size=4)
    K.utils.set_random_seed(0)
    model = K.Sequential([K.Input((3,)), K.layers.Dense(4, activation="tanh"), K.layers.Dense(2)])
    per_example = K.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    variables = model.trainable_variables
    expected = [np.zeros(v.shape, np.float32) for v in variables]
    for i in range(4):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example(y[i : i + 1], model(x[i : i + 1])))
        grads = [g.numpy() for g in tape.gradient(loss, [v.value if front.name == "keras3" else v for v in variables])]
        scale = min(1.0, 0.1 / np.sqrt(sum(np.sum(g * g) for g in grads)))
        expected = [e + scale * g / 4 for e, g in zip(expected, grads)]
    opt = _opt(front, 0.1, 0.0)
    loss_fn = lambda: per_example(y, model(x, training=True))  # noqa: E731
    if front.name == "keras3":
        got = [g.numpy() for g in opt.sanitize(loss_fn, variables)]
    else:
        got = [g.numpy() for g, _ in opt.compute_gradients(loss_fn, variables)]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


def test_eager_minimize_accumulates_a_lot_of_two_batches(front):
    """gradient_accumulation_steps = 2: two eager minimize calls are one lot, released once, of their 4 examples."""
    var = _variable(front, START)
    opt = _opt(front, 1e6, 0.0, gradient_accumulation_steps=2)
    first, second = tf.constant(DATA[:2]), tf.constant(DATA[2:])
    opt.minimize(_loss(var, first), [var])
    np.testing.assert_array_equal(np.array(_read(var)), START)  # half a lot: nothing applied yet
    opt.minimize(_loss(var, second), [var])
    np.testing.assert_allclose(np.array(_read(var)), START - 2.0 * (START - DATA.mean(axis=0)), rtol=1e-6)
    assert int(opt.noised_steps.numpy()) == 1


def test_a_custom_loops_tf_function_converts_only_the_users_code(front, tmp_path, monkeypatch):
    """In a custom loop's ``tf.function`` AutoGraph rewrites the user's step only: the optimizer's functions run as
    written (``do_not_convert``). Before, its first trace converted ~110 of the library's functions (and json's),
    about 10 s of CPU and a warning for a function it could not convert. AutoGraph writes each conversion into a
    file of the temporary directory, which this test points at `tmp_path` (a function already converted in this
    process is cached and writes none: run alone, this test failed before the change)."""
    import re
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    var = _variable(front, START)
    opt = _opt(front, 1e6, 0.0)

    @tf.function
    def users_own_step(x):
        with tf.GradientTape() as tape:
            loss = 0.5 * tf.reduce_sum(tf.math.squared_difference(_read(var), x), axis=1)
        opt.minimize(loss, [var], tape)

    users_own_step(tf.constant(DATA))
    np.testing.assert_allclose(np.array(_read(var)), START - 2.0 * (START - DATA.mean(axis=0)), rtol=1e-6)
    converted = {
        n for f in tmp_path.glob("__autograph_generated_file*") for n in re.findall(r"def tf__(\w+)", f.read_text())
    }
    assert converted <= {"users_own_step", "_read"}, sorted(converted)  # the test's own functions only
