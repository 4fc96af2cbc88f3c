"""Fast per-example clipping of Conv1D/Conv2D (im2col patches, mixed ghost norm) vs loop and reference."""

import pytest
import tf_keras as keras
from _fast_helpers import check, data, per_layer_factors

L = keras.layers


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3, strides=2, padding="same"),
        dict(kernel_size=(3, 2), strides=(1, 2), padding="valid"),
        # Dilated convs run as SpaceToBatchND + Conv2D: rows are not examples, so the kernel
        # must fall back to per-example jacobians (the bias stays on the fast path).
        dict(kernel_size=2, dilation_rate=2, padding="same"),
        dict(kernel_size=3, padding="valid", filters_override=16),  # ghost norm for conv (T small)
    ],
)
def test_conv2d_variants(kwargs):
    kwargs = dict(kwargs)
    filters = kwargs.pop("filters_override", 4)
    size = 4 if filters == 16 else 9
    x, y = data((3, size, size, 3), (3, 2), seed=5)
    model = keras.Sequential([L.Conv2D(filters, activation="relu", **kwargs), L.Flatten(), L.Dense(2)])
    model(x[:1])
    check(model, x, y)  # Dilated too: the kernel's rule sums each example's SpaceToBatchND blocks.


def test_conv1d_causal_and_pooling():
    x, y = data((4, 10, 3), (4, 2), seed=6)
    model = keras.Sequential(
        [
            L.Conv1D(5, 3, padding="causal", activation="relu"),
            L.MaxPooling1D(2),
            L.Conv1D(4, 2, strides=2),
            L.GlobalAveragePooling1D(),
            L.Dense(2),
        ]
    )
    check(model, x, y, factors=per_layer_factors([0.5, 0.1, 0.5, 0.1, 1.0, 0.2]))


# Each materialization of _conv.form, forced: one matmul per kernel tap, the channels-first patches, the
# column-stacked shifts per kernel row (by shape they serve many / few channels with small / larger patches).
@pytest.mark.parametrize("how, cin", [("tap", 32), ("patches", 3), ("row", 3)])
@pytest.mark.parametrize(
    "strides, rates, padding, kernel",
    [
        ((1, 1), (1, 1), "SAME", (3, 3)),
        ((2, 1), (1, 1), "SAME", (3, 2)),
        ((2, 2), (1, 1), "VALID", (2, 3)),
        ((1, 1), (2, 1), "SAME", (3, 3)),
        ((1, 2), (1, 1), "SAME", (4, 4)),  # even kernel: TF pads less before than after
        # Stride phases (_conv._phased): padded sizes that the stride does not divide, a stride above the kernel.
        ((3, 2), (1, 1), "SAME", (3, 3)),
        ((3, 3), (1, 1), "VALID", (2, 2)),
        ((2, 2), (1, 1), "VALID", (1, 1)),
    ],
)
def test_per_example_kernel_grads_match_one_example_loop(monkeypatch, how, cin, strides, rates, padding, kernel):
    import numpy as np
    import tensorflow as tf

    from keras_dpsgd.backends.tensorflow import _conv

    monkeypatch.setattr(_conv, "form", lambda *shape: how)

    gen = np.random.default_rng(11)
    x = tf.constant(gen.normal(size=(3, 7, 6, cin)), tf.float32)
    w = tf.constant(gen.normal(size=(*kernel, cin, 5)), tf.float32)
    s4, r4 = [1, *strides, 1], [1, *rates, 1]
    y = tf.nn.conv2d(x, w, s4, padding, dilations=r4)
    g = tf.constant(gen.normal(size=y.shape), tf.float32)
    parts = _conv.per_example_kernel_grads(x, g, kernel, s4, r4, padding)
    got = tf.concat([tf.reshape(q, [3, -1]) for q in parts], axis=1).numpy().reshape(3, *w.shape)
    for i in range(3):  # Oracle: d/dw of <conv(x_i, w), g_i>, one example at a time.
        with tf.GradientTape() as tape:
            tape.watch(w)
            # tf.nn.convolution: dilated convs through SpaceToBatchND (CPU has no dilated backprop).
            out = tf.nn.convolution(x[i : i + 1], w, strides, padding, dilations=rates)
            inner = tf.reduce_sum(out * g[i : i + 1])
        np.testing.assert_allclose(got[i], tape.gradient(inner, w).numpy(), rtol=1e-4, atol=1e-4)


# The Conv2D kernel rule's forms (handlers._conv2d), each forced on the same small convolutions: the Gram form over
# im2col patches (uses.ghost_preferred true: the cost rule's choice where the output has few positions) and the
# three materializations of _conv.form (ghost_preferred false).
CONV_FORMS = {"gram": (True, None), "tap": (False, "tap"), "patches": (False, "patches"), "row": (False, "row")}


@pytest.mark.parametrize("form", sorted(CONV_FORMS))
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3, strides=2, padding="same"),
        dict(kernel_size=(2, 3), strides=(1, 2), padding="valid"),
        dict(kernel_size=2, dilation_rate=2, padding="same"),  # SpaceToBatchND blocks, summed per example
    ],
)
def test_each_conv2d_kernel_form_matches_the_one_example_loop(monkeypatch, form, kwargs):
    from keras_dpsgd.backends.tensorflow import _conv, uses

    ghost, how = CONV_FORMS[form]
    monkeypatch.setattr(uses, "ghost_preferred", lambda t, d, u: ghost)
    if how is not None:
        monkeypatch.setattr(_conv, "form", lambda *shape: how)
    x, y = data((3, 7, 6, 3), (3, 2), seed=9)
    model = keras.Sequential([L.Conv2D(4, activation="relu", **kwargs), L.Flatten(), L.Dense(2)])
    model(x[:1])
    check(model, x, y, reference=False)


def test_conv_many_channels_strided_and_shared():
    """cin >= 32 takes the per-tap path; a layer applied twice sums its uses before the norm."""
    x, y = data((3, 6, 6, 2), (3, 2), seed=12)
    wide = L.Conv2D(32, 3, padding="same", activation="relu")
    shared = L.Conv2D(32, 3, strides=2, padding="same")
    inputs = keras.Input((6, 6, 2))
    h = wide(inputs)
    h = shared(shared(h))  # weight sharing: 6x6 -> 3x3 -> 2x2
    out = L.Dense(2)(L.Flatten()(L.Conv2D(4, 2, padding="valid")(h)))
    model = keras.Model(inputs, out)
    check(model, x, y)
    check(model, x, y, factors=per_layer_factors([0.3, 0.1, 0.2, 0.1, 0.3, 0.1, 1.0, 0.2]))


def test_conv1d_many_channels():
    x, y = data((2, 12, 32), (2, 2), seed=13)
    model = keras.Sequential([L.Conv1D(6, 3, strides=2, padding="same"), L.Flatten(), L.Dense(2)])
    model(x[:1])
    check(model, x, y)


def test_pointwise_conv_with_few_channels_keeps_the_kernel_shape():
    """A 1 x k kernel on < 32 channels is one piece [B, k, cin, cout]: the clipped sum must still
    be shaped [1, k, cin, cout] (it came back as [k, cin, cout] before)."""
    model = keras.Sequential(
        [keras.Input((5, 5, 3)), keras.layers.Conv2D(4, 1), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    x, y = data((3, 5, 5, 3), (3, 2), seed=7)
    check(model, x, y, reference=False)


def test_grouped_conv2d_on_the_reference_backend_is_refused():
    """TensorFlow's vectorized jacobian (pfor) gets grouped convolutions' per-example gradients
    wrong (checked here against the one-example loop), so the reference backend, which would take
    them, refuses the model; the fast backend's rule is in tests/backends/tensorflow/test_fast_grouped_conv.py."""
    import numpy as np
    import tensorflow as tf

    import keras_dpsgd.tf_keras as kt

    x, y = data((3, 5, 5, 4), (3, 2), seed=8)
    model = keras.Sequential([L.Conv2D(4, 3, groups=2), L.Flatten(), L.Dense(2)])
    model(x[:1])
    kernel = model.trainable_variables[0]
    with tf.GradientTape() as tape:
        losses = tf.reduce_sum((model(x) - y) ** 2, axis=1)
    try:
        pfor = tape.jacobian(losses, kernel)
    except tf.errors.InvalidArgumentError:
        pfor = None  # on some machines pfor fails outright ("filter_size does not have enough elements")
    if pfor is not None:
        loop = []
        for i in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((model(x[i : i + 1]) - y[i : i + 1]) ** 2)
            loop.append(tape.gradient(loss, kernel))
        assert not np.allclose(pfor.numpy(), np.stack(loop), atol=1e-3)  # the TensorFlow bug being refused
    opt = kt.DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, per_example_backend="reference")
    model.compile(optimizer=opt, loss=keras.losses.MeanSquaredError(reduction="none"))
    with pytest.raises(ValueError, match="grouped convolution.*Only the fast per-example backend"):
        model.fit(x, y, batch_size=3, epochs=1, verbose=0)


class _TwoRowsPerExample(keras.Model):
    """[B, 2, 8, 8, 1] -> conv on [2B, 8, 8, 1] -> [B, 2·6·6·3]: each example owns 2 rows of the conv input."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = L.Conv2D(3, 3, activation="tanh"), L.Dense(2)

    def call(self, x):
        import tensorflow as tf

        h = self.conv(tf.reshape(x, [-1, 8, 8, 1]))
        return self.out(tf.reshape(h, [-1, 2 * 6 * 6 * 3]))


def test_conv2d_kernel_sums_the_rows_of_each_example():
    """The materialized kernel rule (6 x 6 output) sums an example's k rows (TimeDistributed-style reshapes,
    the views of augmentation multiplicity); it took one row per example and failed with a shape error."""
    x, y = data((3, 2, 8, 8, 1), (3, 2), seed=7)
    check(_TwoRowsPerExample(), x, y)


@pytest.mark.parametrize("strides, padding", [((1, 1), "SAME"), ((2, 2), "SAME"), ((3, 2), "VALID")])
def test_per_example_depthwise_grads_match_one_example_loop(strides, padding):
    """The depthwise kernel's per-example gradients (taps of the stride phases) against one example at a time."""
    import numpy as np
    import tensorflow as tf

    from keras_dpsgd.backends.tensorflow import _conv

    gen = np.random.default_rng(12)
    x = tf.constant(gen.normal(size=(3, 7, 8, 4)), tf.float32)
    w = tf.constant(gen.normal(size=(3, 3, 4, 2)), tf.float32)
    s4 = [1, *strides, 1]
    y = tf.nn.depthwise_conv2d(x, w, s4, padding)
    g = tf.constant(gen.normal(size=y.shape), tf.float32)
    parts = _conv.per_example_depthwise_grads(x, g, (3, 3), s4, [1, 1, 1, 1], padding)
    got = tf.concat([tf.reshape(q, [3, -1]) for q in parts], axis=1).numpy().reshape(3, *w.shape)
    for i in range(3):
        with tf.GradientTape() as tape:
            tape.watch(w)
            inner = tf.reduce_sum(tf.nn.depthwise_conv2d(x[i : i + 1], w, s4, padding) * g[i : i + 1])
        np.testing.assert_allclose(got[i], tape.gradient(inner, w).numpy(), rtol=1e-4, atol=1e-4)
