"""The library's Gaussian sampler on torch (the torch backend's noise source).

The same Box–Muller as the TensorFlow and JAX samplers (:mod:`keras_dpsgd.step._noise`, whose docstring explains
why a library's own normal, clamped or truncated, does not serve the Gaussian mechanism): ``u1 = (x0 + ½)·2⁻³²``
from a full 32-bit word, refined by two more words where ``x0 = 0``, so the radius reaches
``sqrt(2·97·ln 2) ≈ 11.6``. The math (``refined_unit``, ``radius``, ``polar``) is that module's, run in numpy
on the words (then one addition on the tensor's device); only the random words are torch's backend's own:

- the words come from numpy's Philox-4x64 counter generator under a 128-bit key (``numpy.random.Philox``): a
  pure function of the key, the same on every platform, and cheap (about 1 ns a word);
- a key is a BLAKE2b digest of its parts (:func:`seeded_key`: the seed, the release's position in the model's
  ledger, the tensor index), so two releases never share a key unless all three agree; without a seed the key
  hashes 16 bytes of OS entropy (``os.urandom``, drawn per optimizer and again on every load, never saved) with
  a per-process release counter (:class:`EntropyKeys`), so restoring a file twice never replays noise.
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import torch

from keras_dpsgd.step._noise import _coarse, polar, refined_unit

__all__ = ["add_gaussian", "standard_normal", "seeded_key", "EntropyKeys", "words"]


def _digest(*parts: int | bytes) -> int:
    """A 128-bit key: BLAKE2b of the parts (ints as signed 16-byte words, bytes as they are)."""
    h = hashlib.blake2b(b"keras_dpsgd/torch-noise", digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else int(part).to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


def seeded_key(seed: int, step, index: int) -> int:
    """The key of tensor `index` of the release at ledger position `step` under an integer `seed`."""
    return _digest(b"seeded", int(seed), int(step), int(index))


class EntropyKeys:
    """The keys of an optimizer without a seed: OS entropy (16 bytes, never saved) and a release counter."""

    def __init__(self):
        self.renew()

    def renew(self) -> None:
        """Fresh entropy (a new optimizer, or after a load): no key of the old stream comes again."""
        self._entropy = os.urandom(16)
        self._releases = 0

    def next_release(self):
        """The key function ``index -> key`` of the next release (each release its own keys)."""
        entropy, release = self._entropy, self._releases
        self._releases += 1
        return lambda index: _digest(b"entropy", entropy, release, int(index))


def words(key: int, n: int) -> np.ndarray:
    """n uniform uint32 words (all 2³² values), a function of `key`: the raw 64-bit outputs of numpy's Philox under
    the 128-bit key, each read as two words (in the machine's byte order)."""
    return np.random.Philox(key=key).random_raw((n + 1) // 2).view(np.uint32)[:n]


def _normal_numpy(n: int, key: int, scale: float) -> np.ndarray:
    """``scale`` · N(0, I_n), float32 [n] in numpy: refinement words drawn only where some ``x0`` is 0.

    The Box–Muller runs in numpy (single-threaded, a few passes over the arrays): torch's many elementwise kernels
    on a CPU shared with other work wait on its thread pool (measured here: 30 ms in numpy, seconds in torch at a
    load of 10 on 2 cores, for 8·10⁵ coordinates). Coordinate j < P is the cosine half of pair j, P + j its sine.
    """
    pairs = (n + 1) // 2
    raw = words(key, 2 * pairs).reshape(2, pairs)
    w0 = raw[0].astype(np.float32)  # float32(x) == 0.0 iff x == 0
    if (raw[0] == 0).any():
        extra = words(_digest(b"refine", key), 2 * pairs).reshape(2, pairs).astype(np.float32)
        u1 = refined_unit(w0, extra[0], extra[1], np.where)
    else:
        u1 = _coarse(w0)
    cos, sin = polar(u1, raw[1].astype(np.float32), np.float32(scale), np)
    return np.concatenate([cos, sin])[:n].astype(np.float32, copy=False)


def standard_normal(shape, key: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """N(0, 1) samples of `shape`, a function of `key` (computed in float32)."""
    shape = tuple(int(s) for s in shape)
    z = torch.from_numpy(_normal_numpy(math.prod(shape), key, 1.0)) if math.prod(shape) else torch.zeros(0)
    return z.reshape(shape).to(device=device or "cpu", dtype=dtype)


def add_gaussian(x: torch.Tensor, stddev, key: int) -> torch.Tensor:
    """``x + N(0, stddev² I)`` with the scale folded into the radius (float32 noise)."""
    if x.numel() == 0:
        return x
    z = torch.from_numpy(_normal_numpy(x.numel(), key, float(stddev))).to(x.device)
    return x + z.reshape(x.shape).to(x.dtype)
