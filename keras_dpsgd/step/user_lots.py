"""User-level DP-SGD: Poisson lots of users, each user's combined contribution clipped once.

With example-level DP, a person who owns many examples is protected only as much as ε allows per example,
times the number of examples (group privacy). User-level DP protects a whole user: the unit that enters a
lot, is clipped and is counted is the user.

:class:`UserPoissonLots` groups the examples by their user id into one block per user, ``[U, M, ...]`` (M
the largest number of examples of one user; shorter blocks padded with zeros and label -1), and samples
users: each user enters a lot independently with probability q (Poisson over users), with all of their
examples. The DP step then sees one "example" per user. Its per-example loss is
:class:`UserMeanLoss`, the mean of the user's per-example losses (padding rows excluded), so its
per-example gradient is the user's mean gradient, g_u = (1/n_u) Σ_{i ∈ u} ∇ℓ_i, which the step clips to C
once: the user's combined contribution has norm at most C, whatever the number of their examples (this is
"clip the user's mean", not "mean of clipped examples": both have sensitivity C; this one needs no change
to the step). Noise σC is added once per lot and the sum divided by the expected number of users in a lot
(``lots.configure(optimizer)`` sets q and L over users). The ledger records q over users: ε protects one
user, and N (for the default δ) is the number of users.

Proof of the grouping, fail closed: a user's examples are one block by construction (one row of the
step's batch; the per-example analysis of the step proves that no op mixes the rows of the batch, i.e. the
users); every example must carry a user id (``user_ids`` of shape (N,)); a user with more examples than
``max_examples_per_user`` is refused rather than split across lots; labels must be integer classes >= 0
(the loss reads -1 as padding). The model sees inputs ``[U, M, ...]``: layers that act on the last axis
(Dense, activations) work unchanged (``keras.Input((M, features))``), others through
``keras.layers.TimeDistributed``; nothing may mix the M examples of a user with another user's.

Keras 3 (TensorFlow and JAX backends).
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import numpy as np

from keras_dpsgd import _validate
from keras_dpsgd.dp.refusals import refuse
from keras_dpsgd.step.lots import PoissonLots

__all__ = ["UserMeanLoss", "UserPoissonLots"]

PADDING_LABEL = -1


def _group(x: np.ndarray, y: np.ndarray, user_ids: Any, max_examples_per_user: Optional[int]):
    """(x blocks [U, M, ...], y blocks [U, M], examples per user [U], the user ids [U])."""
    n = len(x)
    ids = np.asarray(user_ids)
    if ids.shape != (n,):
        raise refuse(
            "user-grouping",
            f"user_ids must give one user id per example, shape ({n},), got shape {ids.shape}: without a user "
            "for every example the grouping of a user's examples cannot be proven",
        )
    if ids.dtype.kind not in "iuUSO" or (ids.dtype.kind == "O" and not all(isinstance(u, (str, int)) for u in ids)):
        raise ValueError(f"user_ids must be integers or strings, got dtype {ids.dtype}")
    labels = np.asarray(y)
    if labels.shape != (n,) or labels.dtype.kind not in "iu" or (labels < 0).any():
        raise refuse(
            "user-grouping",
            f"y must be integer class labels >= 0 of shape ({n},) (the user-level loss reads {PADDING_LABEL} as "
            f"padding), got shape {labels.shape} and dtype {labels.dtype}",
        )
    users, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    longest = int(counts.max())
    if max_examples_per_user is None:
        m = longest
    else:
        m = _validate.integer_at_least(1, max_examples_per_user=max_examples_per_user)
        if longest > m:
            raise refuse(
                "user-grouping",
                f"max_examples_per_user must be at least the largest number of examples of one user ({longest}, "
                f"user {users[int(np.argmax(counts))].tolist()!r}), got {m}: a user's examples are never split across lots",
            )
    order = np.argsort(inverse, kind="stable")
    slot = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # position of each example in its block
    xb = np.zeros((len(users), m) + x.shape[1:], dtype=x.dtype)
    yb = np.full((len(users), m), PADDING_LABEL, dtype=np.int64)
    xb[inverse[order], slot] = x[order]
    yb[inverse[order], slot] = labels[order]
    return xb, yb, counts, users


class UserPoissonLots(PoissonLots):
    """Poisson lots of users: each user enters a lot with probability q, with all of their examples.

    A :class:`~keras_dpsgd.PoissonLots` over user blocks (see the module docstring): ``dataset()``
    yields ``(x [U, M, ...], y [U, M], weight [U])``; ``configure(optimizer)`` sets the optimizer's
    sampling rate and expected lot size over users. Compile with ``loss=UserMeanLoss(...)``.

    Args:
      x: inputs, an array of shape (N, ...) (one row per example).
      y: integer class labels >= 0, shape (N,).
      user_ids: the user of every example, shape (N,) (integers or strings).
      expected_users_per_lot: L, the expected number of users in a lot (q = L / number of users).
      max_examples_per_user: M, the block size; default the largest user's count (a user with more
        examples is refused, never split).
      seed: None (default: OS entropy) or an integer, for tests only.
      **kwargs: the other arguments of :class:`~keras_dpsgd.PoissonLots` (``physical_batch_size``, ...).

    Raises:
      ValueError: a missing or malformed user id, labels that are not classes >= 0, a user larger than
        `max_examples_per_user`, or a bad argument of PoissonLots.
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        user_ids: Any,
        *,
        expected_users_per_lot: float,
        max_examples_per_user: Optional[int] = None,
        seed: Optional[int] = None,
        **kwargs: Any,
    ):
        if "sample_weight" in kwargs or "sampling_rate" in kwargs or "expected_lot_size" in kwargs:
            raise ValueError(
                "UserPoissonLots takes expected_users_per_lot (no sampling_rate, expected_lot_size or "
                f"sample_weight), got {sorted(k for k in kwargs if k in ('sample_weight', 'sampling_rate', 'expected_lot_size'))}"
            )
        x = np.asarray(x)
        xb, yb, counts, users = _group(x, y, user_ids, max_examples_per_user)
        self._examples_per_user = counts
        self._users = users
        lot = _validate.in_range(0, len(users), "(]", expected_users_per_lot=expected_users_per_lot)
        super().__init__(xb, yb, expected_lot_size=lot, seed=seed, **kwargs)

    @property
    def num_users(self) -> int:
        """The number of users (N of the user-level guarantee)."""
        return self.num_examples

    @property
    def max_examples_per_user(self) -> int:
        """M, the examples of a user block (the model's second input axis)."""
        return int(self._x.shape[1])

    @property
    def examples_per_user(self) -> np.ndarray:
        """n_u of every user, in the order of :attr:`user_ids`."""
        return self._examples_per_user.copy()

    @property
    def user_ids(self) -> np.ndarray:
        """The users, in block order."""
        return self._users.copy()

    def configure(self, optimizer: Any) -> Any:
        """Sets the optimizer's sampling rate and expected lot size over users; returns it."""
        optimizer = super().configure(optimizer)
        optimizer.privacy_unit = "user"
        return optimizer


@keras.saving.register_keras_serializable(package="keras_dpsgd")
class UserMeanLoss(keras.losses.Loss):
    """A user's loss: the mean of their examples' losses, padding rows (label -1) excluded.

    With :class:`UserPoissonLots` each row of the step's batch is one user's block ``[M, ...]``; this loss
    gives one value per user, so the step's per-example gradient is the user's mean gradient, clipped
    once. Keras 3 (``keras.ops``: TensorFlow and JAX backends); saved with the model.

    Args:
      loss: a Keras 3 loss object whose ``call(y_true [U, M], y_pred [U, M, ...])`` gives the examples'
        losses ``[U, M]``, e.g. ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``.
      name: the loss's name.
    """

    def __init__(self, loss: Any, name: str = "user_mean_loss", **kwargs: Any):
        super().__init__(name=name, **kwargs)
        if not isinstance(loss, keras.losses.Loss):
            raise TypeError(
                "loss must be a Keras 3 loss object (e.g. keras.losses.SparseCategoricalCrossentropy("
                f"from_logits=True)), got {type(loss).__name__}"
            )
        self.loss = loss

    def call(self, y_true, y_pred):
        y_true = keras.ops.cast(y_true, "int32")
        real = keras.ops.cast(keras.ops.greater_equal(y_true, 0), y_pred.dtype)
        rows = self.loss.call(keras.ops.maximum(y_true, 0), y_pred)
        count = keras.ops.maximum(keras.ops.sum(real, axis=1), 1.0)
        return keras.ops.sum(rows * real, axis=1) / count

    def get_config(self) -> dict:
        return {**super().get_config(), "loss": keras.losses.serialize(self.loss)}

    @classmethod
    def from_config(cls, config: dict) -> "UserMeanLoss":
        config = dict(config)
        return cls(keras.losses.deserialize(config.pop("loss")), **config)
