"""The canary-audit set-ups shared by the audit tests on both Kerases.

tests/audit/test_audit_canaries.py and tests/audit/test_audit_step.py run them on tf_keras, tests/keras3/test_keras3_audit.py on Keras 3
(scikit-learn digits, a small MLP: cheap on 2 CPU cores).
"""

from keras_dpsgd.audit import canary_audit, step_audit
from keras_dpsgd.audit.one_run import mlp_builder

DELTA = 1e-5


def without_noise(optimizer_cls):
    """A deliberately broken subclass of `optimizer_cls`: no noise is added, while the ledger still charges σ."""

    class NoNoiseDPSGD(optimizer_cls):
        def add_noise(self, summed):
            return list(summed)

    return NoNoiseDPSGD


def scaled_noise(optimizer_cls, factor):
    """A deliberately broken subclass: the noise it adds is `factor` × the noise σ charges (the ledger charges σ)."""

    class ScaledNoiseDPSGD(optimizer_cls):
        def add_noise(self, summed):
            noised = optimizer_cls.add_noise(self, summed)
            return [s + factor * (n - s) for s, n in zip(summed, noised)]

    return ScaledNoiseDPSGD


def step_audit_run(keras_module, digits, sigma=1.0, *, seed, optimizer_cls=None, delta=None, epochs=2):
    """The white-box step audit at noise multiplier `sigma` (digits, 64-unit MLP, C = 10, lots of 64, a canary
    on every coordinate), at δ = 1/N^1.1 (the CLI's default when issue 30 set the expected ε = 2.07) unless `delta`."""
    return step_audit(
        mlp_builder(digits.input_shape, 10, width=64, keras_module=keras_module),
        (digits.x_train, digits.y_train),
        num_classes=10,
        noise_multiplier=sigma,
        seed=seed,
        optimizer_cls=optimizer_cls,
        delta=len(digits.y_train) ** -1.1 if delta is None else delta,
        l2_norm_clip=10.0,
        lot_size=64,
        epochs=epochs,
    )


# Dirac gradient canaries audit the step without memorization; C = 10 is large against the data's
# own (unclipped) per-coordinate gradients, the main noise of the score without DP noise.
_GRADIENT = dict(width=64, kind="gradient", l2_norm_clip=10.0, lot_size=64, epochs=2)
# Out-of-distribution input canaries need memorization: a 256-unit MLP without noise, C = 100 (inactive).
_INPUT = dict(width=256, kind="ood", noise_multiplier=0.0, l2_norm_clip=100.0, lot_size=256, seed=1)


def gradient_audit(keras_module, digits, sigma, seed, optimizer_cls=None, canaries=1000):
    """The gradient-canary audit at noise multiplier `sigma` (a number, or a callable of the lots and δ)."""
    return _audit(
        keras_module,
        digits,
        noise_multiplier=sigma,
        seed=seed,
        optimizer_cls=optimizer_cls,
        canaries=canaries,
        **_GRADIENT,
    )


def input_canary_audit(keras_module, digits, *, canaries, epochs):
    """The input-canary audit without noise (memorization is seen)."""
    return _audit(keras_module, digits, canaries=canaries, epochs=epochs, **_INPUT)


def _audit(keras_module, digits, *, width, **settings):
    return canary_audit(
        mlp_builder(digits.input_shape, 10, width=width, keras_module=keras_module),
        (digits.x_train, digits.y_train),
        num_classes=10,
        delta=DELTA,
        **settings,
    )
