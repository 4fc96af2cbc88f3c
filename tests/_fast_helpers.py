"""Shared helpers for the fast-backend tests: run a backend in a traced step, and the oracle loop."""

import numpy as np
import tensorflow as tf
import tf_keras as keras

from keras_dpsgd.backends.tensorflow import FastBackend
from keras_dpsgd.backends.tensorflow._backend import _reference_backend


def per_example_loss(model, x, y, weights=None):
    """Squared error summed over the non-batch axes, one value per example."""
    out = model(x)
    err = tf.reshape(tf.square(out - y), [tf.shape(out)[0], -1])
    loss = tf.reduce_sum(err, axis=1)
    return loss if weights is None else loss * weights


def flat_factors(clip):
    """Flat clipping: one factor per example from the total norm (Abadi et al. 2016)."""

    def fn(sq_norms):
        norm = tf.sqrt(tf.reduce_sum(sq_norms, axis=1, keepdims=True))
        factor = tf.minimum(1.0, clip / tf.maximum(norm, 1e-12))
        return tf.broadcast_to(factor, tf.shape(sq_norms))

    return fn


def per_layer_factors(clips):
    """Per-variable clipping: column v clipped to clips[v]."""
    bounds = tf.constant(clips, tf.float32)

    def fn(sq_norms):
        return tf.minimum(1.0, bounds / tf.maximum(tf.sqrt(sq_norms), 1e-12))

    return fn


def traced_step(backend, model, x, y, factors_fn, weights=None, dynamic_dims=1):
    """backend.clipped_sum inside one tf.function, with a None batch dimension: a callable
    ``(x, y[, weights]) -> (summed, sq_norms)`` (numpy) traced once for every batch size.

    `x`, `y` (and `weights`) give the shapes; `dynamic_dims` leading dims of x and y are left unknown
    in the traced graph.
    """

    def spec(a, k):
        return tf.TensorSpec([None] * k + list(a.shape[k:]), a.dtype)

    specs = [spec(x, dynamic_dims), spec(y, 1)]
    if weights is not None:
        specs.append(tf.TensorSpec([None], tf.float32))

    # autograph=False: straight-line code (a Python `if` on a tensor in the library would raise here, not pass);
    # autograph's conversion of the library's code is a large part of each trace.
    @tf.function(input_signature=specs, autograph=False)
    def step(x, y, *w):
        with tf.GradientTape() as tape:
            loss = per_example_loss(model, x, y, w[0] if w else None)
        return backend.clipped_sum(loss, model.trainable_variables, tape, factors_fn)

    def run(*args):
        summed, sq_norms = step(*args)
        return [s.numpy() for s in summed], sq_norms.numpy()

    return run


def run_traced(backend, model, x, y, factors_fn, weights=None, dynamic_dims=1):
    """Calls backend.clipped_sum inside a tf.function, with a None batch dimension.

    `dynamic_dims` leading dims of x and y are left unknown in the traced graph.
    """
    step = traced_step(backend, model, x, y, factors_fn, weights, dynamic_dims)
    return step(x, y) if weights is None else step(x, y, weights)


def loop_oracle(model, x, y, factors_fn, weights=None):
    """One example at a time (eager): per-example gradients, norms, factors, clipped sums."""
    variables = model.trainable_variables
    grads = []
    for i in range(x.shape[0]):
        with tf.GradientTape() as tape:
            w = None if weights is None else weights[i : i + 1]
            loss = per_example_loss(model, x[i : i + 1], y[i : i + 1], w)[0]
        g = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads.append([tf.convert_to_tensor(gv).numpy() for gv in g])
    sq = np.array([[np.sum(np.square(gv)) for gv in row] for row in grads], np.float32)
    factors = factors_fn(tf.constant(sq)).numpy()
    summed = [sum(factors[i, v] * grads[i][v] for i in range(len(grads))) for v in range(len(variables))]
    return summed, sq


# The backends' squared norms are certified upper bounds (keras_dpsgd.dp.rounding): above the loop's float32
# values by at most their rounding margin, γ_{D+U+1}·(S/N)² relative for a ghost norm (about 2e-4 for a 3x3x32
# convolution's patches on 13 positions), never below them by more than the loop's own rounding.
SQ_RTOL = 1e-3


def assert_same(got, want, rtol=2e-4, atol=2e-5):
    summed, sq = got
    want_summed, want_sq = want
    np.testing.assert_allclose(sq, want_sq, rtol=max(rtol, SQ_RTOL), atol=atol)
    assert np.all(sq >= want_sq * (1 - rtol) - atol), "a squared norm below the loop's"
    assert len(summed) == len(want_summed)
    for s, w in zip(summed, want_summed):
        assert s.shape == w.shape
        np.testing.assert_allclose(s, w, rtol=rtol, atol=atol)


def rng(seed=0):
    return np.random.default_rng(seed)


def data(x_shape, y_shape, seed=0):
    gen = rng(seed)
    return gen.normal(size=x_shape).astype("float32"), gen.normal(size=y_shape).astype("float32")


def sequence_data(batch, steps, features, out, masked, seed=0):
    """Sequences [batch, steps, features] and targets [batch, *out]; ``masked``: some steps are
    all zeros, which Masking(0.0) drops: a tail, a head and a middle step."""
    x, y = data((batch, steps, features), (batch,) + out, seed=seed)
    if masked:
        x[0, steps - 2 :] = 0.0
        if batch > 1:
            x[1, :2] = 0.0
            x[-1, 2] = 0.0
    return x, y


def check(model, x, y, factors=None, fallback=(), reference=True, dynamic_dims=1, first_rows=()):
    """Fast backend == one-example loop (== the reference jacobian path if `reference`).

    `fallback` lists the variables expected to use per-example jacobians; each n in `first_rows`
    also runs the batch ``x[:n]`` through the same fast trace (batch size None) against the loop.
    """
    tf.random.set_seed(1)
    model(x[:1])
    factors = factors or flat_factors(1.0)
    backend = FastBackend()
    step = traced_step(backend, model, x, y, factors, dynamic_dims=dynamic_dims)
    got = step(x, y)
    assert sorted(backend.last_fallback) == sorted(v.name for v in fallback)
    assert_same(got, loop_oracle(model, x, y, factors))
    for n in first_rows:
        assert_same(step(x[:n], y[:n]), loop_oracle(model, x[:n], y[:n], factors))
    if reference:
        assert_same(got, run_traced(_reference_backend(), model, x, y, factors))
    return got


def dense_mlp():
    return keras.Sequential([keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])


class TfVariables:
    """A Keras 3 model seen through its tf.Variables (what the keras3 optimizer hands the backend)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        return self.model(x)

    @property
    def trainable_variables(self):
        return [v.value for v in self.model.trainable_variables]


class Wrap(keras.Model):
    """Calls an inner model through `fn(inner, x)` (tracks the inner model's variables)."""

    def __init__(self, inner, fn):
        super().__init__()
        self.inner = inner
        self.fn = fn

    def call(self, x):
        return self.fn(self.inner, x)
