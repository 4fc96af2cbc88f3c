"""The one place that builds a private optimizer class, for both front ends (tf_keras, Keras 3).

Each front end checks that the class it is given belongs to its Keras and passes its own sanitizer
mixin, module name, docstring and registration function; the constructor (its DP arguments are
checked once, by ``keras_dpsgd.step.settings``), the cache (the same class for the same optimizer
class) and the registration are shared. No Keras is imported here.
"""

from __future__ import annotations

from typing import Any, Callable

from keras_dpsgd import backends
from keras_dpsgd.step.clipping import DEFAULT_STABILITY
from keras_dpsgd.step.settings import check_settings
from keras_dpsgd.step._tfp_compat import check_num_microbatches


def init_private(
    optimizer: Any,
    base_init: Callable[..., None],
    l2_norm_clip: Any,
    noise_multiplier: Any,
    gradient_accumulation_steps: int,
    expected_lot_size: float | None,
    sampling_rate: float | None,
    per_example_backend: str,
    seed: int | None,
    num_microbatches: None,
    base_kwargs: dict[str, Any],
    jacobian_fallback: str = "warn",
    *,
    clipping: str = "clip",
    stability: float = DEFAULT_STABILITY,
) -> None:
    """Constructs a private optimizer: checks the DP arguments, runs the Keras ``__init__``, then ``_init_dp``.

    Args:
      optimizer: the optimizer being constructed (its class has a sanitizer mixin).
      base_init: the Keras optimizer's ``__init__``, bound to `optimizer`.
      l2_norm_clip, noise_multiplier, gradient_accumulation_steps, expected_lot_size, sampling_rate,
        per_example_backend, seed, jacobian_fallback, clipping, stability: the DP arguments
        (``keras_dpsgd.step.settings.check_settings``).
      num_microbatches: None only (refused otherwise).
      base_kwargs: the keywords of the Keras optimizer.
    """
    check_num_microbatches(num_microbatches)
    state = check_settings(
        l2_norm_clip,
        noise_multiplier,
        gradient_accumulation_steps=gradient_accumulation_steps,
        expected_lot_size=expected_lot_size,
        sampling_rate=sampling_rate,
        per_example_backend=per_example_backend,
        jacobian_fallback=jacobian_fallback,
        seed=seed,
        clipping=clipping,
        stability=stability,
        keras_backend=backends.keras_backend_of(optimizer),
    )
    base_init(**base_kwargs)
    optimizer._init_dp(state)


def make_dp_class(
    optimizer_cls: type,
    mixin: type,
    *,
    name: str | None,
    module: str,
    doc: str,
    register: Callable[[type], type],
    cache: dict[type, type],
    error: type[Exception],
    base: type | None = None,
) -> type:
    """The private class of `optimizer_cls` (a class of the caller's Keras), made once per class.

    Args:
      optimizer_cls: the Keras optimizer class.
      mixin: the front end's sanitizer mixin, put before `optimizer_cls`.
      name: class name; None gives "DP<Name>Optimizer".
      module: the new class's ``__module__``.
      doc: its docstring.
      register: registers the class for Keras serialization and returns it.
      cache: the front end's classes by optimizer class (read and updated).
      error: the front end's exception type for an `optimizer_cls` that is private already.
      base: the class the private class derives from: `optimizer_cls` (None), or a subclass of it with the same
        descent rule (Keras's fused torch version: ``keras_dpsgd.backends.torch.keras_optimizer_base``).

    Raises:
      error: if `optimizer_cls` is private already (a subclass of `mixin`).
    """
    if issubclass(optimizer_cls, mixin):
        raise error(f"optimizer_cls is already private: {optimizer_cls.__name__}")
    if optimizer_cls in cache:
        return cache[optimizer_cls]
    cls_name = name or f"DP{optimizer_cls.__name__}Optimizer"

    def __init__(
        self,
        l2_norm_clip,
        noise_multiplier,
        *,
        gradient_accumulation_steps=1,
        expected_lot_size=None,
        sampling_rate=None,
        per_example_backend="auto",
        jacobian_fallback="warn",
        seed=None,
        num_microbatches=None,
        clipping="clip",
        stability=DEFAULT_STABILITY,
        **kwargs,
    ):
        kwargs.setdefault("name", cls_name)
        base_init = lambda **base_kwargs: optimizer_cls.__init__(self, **base_kwargs)  # noqa: E731
        dp_args = (gradient_accumulation_steps, expected_lot_size, sampling_rate, per_example_backend, seed)
        init_private(
            self,
            base_init,
            l2_norm_clip,
            noise_multiplier,
            *dp_args,
            num_microbatches,
            kwargs,
            jacobian_fallback,
            clipping=clipping,
            stability=stability,
        )

    bases = (mixin, optimizer_cls if base is None else base)
    cls = type(cls_name, bases, {"__init__": __init__, "__doc__": doc, "__module__": module})
    cache[optimizer_cls] = register(cls)
    return cls
