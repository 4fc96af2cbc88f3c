"""Every walk of the call stack in keras_dpsgd, in one module.

Keras offers no supported way to learn, from inside an optimizer's
``save_own_variables``, which model is being saved (a ``.keras`` save walks
the model's children without passing the model down), nor to read the
running ``fit``'s arguments (its data_handler's steps per epoch,
validation_split) from a callback or the optimizer, nor, in tf_keras, which
model's train step calls the optimizer (the optimizer API never receives the
model). These reads are the only ones that look up the stack:
:func:`calling_frame` (the ledger's), :func:`fit_frame` and
:func:`find_calling_model`.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


def calling_frame(matches, max_depth: int):
    """The nearest frame up the call stack (below the caller's caller) for which `matches(frame)`."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        if matches(frame):
            return frame
        frame = frame.f_back
    return None


def fit_frame(model: Any, max_depth: int = 64):
    """The frame of the running ``Model.fit`` of `model` (its locals: x, data_handler, ...), or None.

    Keras gives neither callbacks nor the optimizer the fit's data; the call
    stack is searched for ``fit``'s frame (see :func:`calling_frame`). Under a
    ``tf.distribute.MirroredStrategy`` the train step is traced in one thread per
    replica, while ``fit`` runs in the thread that called it: from another thread,
    the other threads' stacks are searched too (deeper: ``fit`` waits below the
    tracing frames there).
    """
    matches = lambda f: f.f_code.co_name == "fit" and f.f_locals.get("self") is model  # noqa: E731
    frame = calling_frame(matches, max_depth)
    if frame is not None or threading.current_thread() is threading.main_thread():
        return frame
    for top in sys._current_frames().values():
        for _ in range(4 * max_depth):
            if top is None or matches(top):
                break
            top = top.f_back
        if top is not None:
            return top
    return None


def find_calling_model(optimizer: Any, max_depth: int = 16) -> Any:
    """The tf_keras Model whose train step is calling `optimizer`, if any.

    The optimizer API never receives the model, so the call stack is searched
    for a ``self`` that is a Model compiled with this optimizer, or with a
    wrapper of it (a LossScaleOptimizer's ``inner_optimizer``): Keras's
    ``train_step`` calls ``self.optimizer.minimize``. Returns None in a custom
    training loop outside a Model method.
    """
    import tf_keras as keras

    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        compiled = getattr(obj, "optimizer", None) if isinstance(obj, keras.Model) else None
        if compiled is not None and optimizer in (compiled, getattr(compiled, "inner_optimizer", None)):
            return obj
        frame = frame.f_back
    return None
