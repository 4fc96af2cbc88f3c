"""The torch backend of keras_dpsgd (Keras 3 with ``KERAS_BACKEND=torch``).

Per-example gradients under ``torch.func.vmap`` (``_per_example``), with norm rules for the common layers (ghost
norms and book-keeping sums: ``ghost``, ``_rules``, the JAX backend's rule interface), the library's Gaussian sampler on random words
of a keyed counter generator (``_noise``) and the table of array operations the DP core runs over (``_ops``). The
private train step is the Keras 3 front end's (``keras_dpsgd.keras3._torch_train_step``, installed by
``keras_dpsgd.keras3.make_private`` when ``keras.config.backend() == "torch"``). What is not built on torch yet is
refused by name (:func:`not_built` names it in the refusal the front end raises), never run on another path. The optimizer's local state (the lot size's
mirror, the non-finite count, the ledger offset: never saved) is TensorFlow's (``make_local_state``), which the
eager step reads.
"""

from typing import Any

from keras_dpsgd.backends.torch import ghost
from keras_dpsgd.backends.tensorflow.ops import make_local_state
from keras_dpsgd.backends.torch._noise import (
    EntropyKeys,
    NoiseAhead,
    add_gaussian,
    seeded_key,
    spare_core,
    standard_normal,
)
from keras_dpsgd.backends.torch._ops import TORCH_OPS
from keras_dpsgd.backends.torch._ops import TORCH_OPS as OPS
from keras_dpsgd.backends.torch._per_example import (
    BatchWrite,
    clipped_sum,
    per_example_grads,
    perturbation_grads,
    sq_norms,
)

__all__ = [
    "BatchWrite",
    "EntropyKeys",
    "NoiseAhead",
    "OPS",
    "PER_EXAMPLE_CHOICES",
    "TORCH_OPS",
    "TORCH_UNSUPPORTED",
    "add_gaussian",
    "clipped_sum",
    "ghost",
    "keras_optimizer_base",
    "make_local_state",
    "not_built",
    "per_example",
    "per_example_grads",
    "perturbation_grads",
    "seeded_key",
    "spare_core",
    "sq_norms",
    "standard_normal",
]

TORCH_UNSUPPORTED = "is not supported on the torch backend yet; use KERAS_BACKEND=tensorflow or jax"

# The seam's interface (keras_dpsgd.backends). "auto": the layers with norm rules (``ghost``, ``_rules``) take their
# norms and clipped sums from their inputs and output gradients, every other variable its gradient under
# torch.func.vmap; "reference": every variable's gradient under torch.func.vmap (each example a batch of one).
# "fast" names TensorFlow's graph analysis and is refused here.
PER_EXAMPLE_CHOICES = ("auto", "reference")


def not_built(feature: str) -> str:
    """The detail of the refusal of a feature not built on torch, naming it (``refuse(kind, not_built(...))``)."""
    return f"{feature} {TORCH_UNSUPPORTED} (KERAS_BACKEND=torch is set)"


def keras_optimizer_base(optimizer_cls: type) -> type:
    """Keras's torch version of a Keras optimizer class where it has one, else `optimizer_cls`.

    On torch, ``keras.optimizers.SGD(...)`` (Adam, RMSprop, ...) builds Keras's subclass of the same name in
    ``keras.src.backend.torch.optimizers``, whose update runs ``torch._foreach`` ops in place over all the
    variables at once; a subclass of the class (a DP optimizer) would take the generic update, one variable and
    several fresh tensors at a time. The same descent rule: the DP class derives from the fused one.
    """
    import importlib

    try:
        module = importlib.import_module(f"keras.src.backend.torch.optimizers.torch_{optimizer_cls.__name__.lower()}")
    except ImportError:
        return optimizer_cls
    fused = getattr(module, optimizer_cls.__name__, None)
    if isinstance(fused, type) and optimizer_cls in fused.__bases__:
        return fused
    return optimizer_cls


def per_example(name: str, jacobian_fallback: str) -> Any:
    """The per-example computation: ``_per_example`` (vmap); `jacobian_fallback` has nothing to fall back from."""
    from keras_dpsgd.backends.torch import _per_example

    return _per_example
