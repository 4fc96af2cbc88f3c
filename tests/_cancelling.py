"""Examples whose rows cancel (issue 37): the sensitivity of a step to removing one of them, σ = 0.

Each case is a small model whose trainable layer sees rows (sequence positions, conv taps, lookups, views)
that nearly cancel in one example's gradient: ``Σ_t a_tᵀ δ_t`` is small while ``S = Σ_t ‖a_t‖ ‖δ_t‖`` is up to
2^20 times larger, so the float32 Gram form ``Σ_{t,s} (a_t·a_s)(δ_t·δ_s)`` of its squared norm is rounding
noise. The step must still clip it: removing it moves the released sum (σ = 0, a fixed expected lot size) by
at most C (1 + 1e-4), whatever the rounding of the machine (the bound is certified, not measured).
"""

from __future__ import annotations

import numpy as np

CLIP = 0.01
LR = 0.5
LOT = 4.0
TOLERANCE = 1e-4
SCALES = (("issue", 1024.0), ("issue", 2.0**20), ("normal", 1e3), ("integer", 2.0**20))
# (case, scale) of the tests: the Dense on a sequence at every scale; the others at the issue's and 2^20.
CASE_SCALES = [("dense", s) for s in SCALES] + [
    (case, s) for case in ("conv", "embedding") for s in (SCALES[0], SCALES[1], SCALES[3])
]


def scale_id(scale) -> str:
    return f"{scale[0]}-{scale[1]:g}"


def case_id(value) -> str:
    return value if isinstance(value, str) else scale_id(value)


def _frozen_head(K, layer, inputs, head=None):
    """`layer` (the one trainable layer) then a frozen linear head: one output, its kernel `head` if given."""
    out = K.layers.Dense(1, use_bias=False, name="head")
    model = K.Sequential([inputs, layer] + ([K.layers.GlobalAveragePooling1D()] if layer.name != "emb" else []))
    if layer.name == "emb":
        model.add(K.layers.Flatten())
    model.add(out)
    if head is not None:
        out.set_weights([np.asarray(head, "float32").reshape(-1, 1)])
    out.trainable = False
    return model


def _rows(rng, scale, width):
    """Two rows r and -r + e, by `scale` (one of ``SCALES``): ``("issue", s)`` the issue's (r = s·e_0,
    e = 0.2·e_1); ``("integer", s)`` random integers below s (exact in float32) and small integer offsets;
    ``("normal", s)`` random rows of scale s."""
    kind, scale = scale
    if kind == "issue":
        r, e = np.zeros(width), np.zeros(width)
        r[0], e[1] = scale, 0.2
    elif kind == "integer":
        r, e = np.round(rng.uniform(-1, 1, size=width) * scale), rng.integers(-2, 3, size=width).astype(float)
    else:
        r, e = rng.normal(size=width) * scale, 0.2 * rng.normal(size=width)
    return r, -r + e


def issue_case(K, scale=("issue", 1024.0), seed=0, bias=False):
    """The issue's measurement: Dense(8, no bias) on Input((2, 8)) → GlobalAveragePooling1D → frozen Dense(1),
    example 0's rows ``x[0,0,0], x[0,1,0], x[0,1,1] = 1024, -1024, 0.2`` (or as :func:`_rows` makes them for
    `scale`), target 10, three ordinary examples beside it; `bias`: the Dense has one (a second variable)."""
    K.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model = _frozen_head(K, K.layers.Dense(8, use_bias=bias), K.Input((2, 8)))
    x = rng.normal(size=(4, 2, 8)).astype("float32") * 0.1
    x[0, 0], x[0, 1] = _rows(rng, scale, 8)
    y = np.full((4, 1), 10.0, "float32")
    return model, x, y


def conv_case(K, scale, seed=0):
    """Conv1D(4, 2, no bias) on Input((3, 4)): example 0's two patches [x0, x1], [x1, x2] sum to small rows."""
    K.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model = _frozen_head(K, K.layers.Conv1D(4, 2, use_bias=False), K.Input((3, 4)))
    x = rng.normal(size=(4, 3, 4)).astype("float32") * 0.1
    r, s = _rows(rng, scale, 4)
    x[0] = [r, s, -s + (r + s)]
    return model, x, np.full((4, 1), 10.0, "float32")


def embedding_case(K, scale, seed=0):
    """Embedding(5, 8) → Flatten → a frozen head whose two halves nearly cancel: example 0 looks up one id twice,
    its two output gradients nearly cancel in that id's row."""
    K.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    head = np.concatenate(_rows(rng, scale, 8))
    model = _frozen_head(K, K.layers.Embedding(5, 8, name="emb"), K.Input((2,), dtype="int32"), head=head)
    x = rng.integers(0, 5, size=(4, 2)).astype("int32")
    x[0] = 3
    return model, x, np.full((4, 1), 10.0, "float32")


def flat_case(K, scale, seed=0):
    """A flat Dense(8, no bias) → frozen Dense(1) whose output is ``x_7`` (the head e_0, the kernel's column 0 e_7):
    example 0 has ``x_7 = 0``, so with the views x and -x + b (b_7 = 0 too, :class:`Negated`) both outputs are 0,
    the views' output gradients are equal and their gradients nearly cancel in the example's mean."""
    K.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model = K.Sequential([K.Input((8,)), K.layers.Dense(8, use_bias=False), K.layers.Dense(1, use_bias=False)])
    kernel = model.layers[0].get_weights()[0]
    kernel[:, 0] = np.eye(8)[7]
    model.layers[0].set_weights([kernel])
    model.layers[-1].set_weights([np.eye(8)[:, :1].astype("float32")])
    model.layers[-1].trainable = False
    x = rng.normal(size=(4, 8)).astype("float32") * 0.1
    x[0] = np.round(rng.uniform(-1, 1, size=8) * scale) if scale >= 2.0**20 else rng.normal(size=8) * scale
    x[0, 7] = 0.0
    return model, x, np.full((4, 1), 10.0, "float32")


class Negated:
    """Augmentation of multiplicity 2: view 0 is x, view 1 is -x + b (b small, b_7 = 0), in the order of the calls."""

    def __init__(self, width, seed=1):
        self.b = (0.2 * np.random.default_rng(seed).normal(size=width)).astype("float32")
        self.b[-1] = 0.0
        self.calls = 0

    def __call__(self, x):
        j, self.calls = self.calls % 2, self.calls + 1
        return x if j == 0 else -x + self.b


def compiled(front, build, private=None, optimizer_cls=None, learning_rate=LR, **dp_kwargs):
    """The case's model, private, compiled with σ = 0 and the expected lot size LOT."""
    model, x, y = build()
    if private or front.always_private:
        front.make_private(model, **(private or {}))
    dp_kwargs.setdefault("l2_norm_clip", CLIP)
    opt = (optimizer_cls or front.optimizer_cls)(
        noise_multiplier=0.0, learning_rate=learning_rate, expected_lot_size=LOT, seed=1, **dp_kwargs
    )
    model.compile(optimizer=opt, loss=front.keras.losses.MeanSquaredError(reduction="none"))
    return model, x, y


def release(model, x, y, learning_rate=LR):
    """The released clipped sum of one step on (x, y), flattened ((before - after) / lr · LOT); the weights are
    restored after."""
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    after = [v.numpy() for v in model.trainable_variables]
    for v, b in zip(model.trainable_variables, before):
        v.assign(b)
    return np.concatenate([((b.astype(np.float64) - a) / learning_rate * LOT).ravel() for b, a in zip(before, after)])


def moved(front, build, fresh=False, **kwargs):
    """‖release(D) - release(D without example 0)‖ for the case `build` returns (model, x, y); one compiled model
    for both unless `fresh` (an optimizer whose state moves with each step, as adaptive clipping's bounds)."""
    model, x, y = compiled(front, build, **kwargs)
    with_it = release(model, x, y)
    if fresh:
        model, x, y = compiled(front, build, **kwargs)
    return float(np.linalg.norm(with_it - release(model, x[1:], y[1:])))
