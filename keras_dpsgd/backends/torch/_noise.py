"""The torch backend's noise source: the DP core's Gaussian sampler (:mod:`keras_dpsgd.dp.noise`) over its tables.

The sampler (Box–Muller with the radius refined where a word is 0, tails to 11.6: why the libraries' own normals
do not serve the Gaussian mechanism is in :mod:`keras_dpsgd.dp.noise`) is written once; here it runs over
``_ops.NOISE_OPS`` (numpy, the Philox words under hashed keys) and the noise is added to the tensor on its device.

Keys: a seeded optimizer's noise is a function of (seed, the release's position in the model's ledger, tensor
index) (:func:`seeded_key`), so reproducible, resumable and never repeated within a model's ledger; without a seed
the key hashes 16 bytes of OS entropy (``os.urandom``, drawn per optimizer and again on every load, never saved)
with a per-process release counter (:class:`EntropyKeys`), so restoring a file twice never replays noise.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from keras_dpsgd.backends.torch._ops import NOISE_OPS, WordReader, digest, stream_key
from keras_dpsgd.dp.noise import noise_key, scaled_pairs

__all__ = ["add_gaussian", "standard_normal", "seeded_key", "EntropyKeys", "NoiseAhead", "spare_core"]


def seeded_key(seed: int, step, index: int) -> int:
    """The key of tensor `index` of the release at ledger position `step` under an integer `seed`."""
    return noise_key(NOISE_OPS, seed, int(step), index)


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
        key = digest(b"entropy", self._entropy, self._releases)
        self._releases += 1
        return lambda index: NOISE_OPS.fold_in(key, index)


# Pairs per chunk of the sampler's float math: each temporary (64 KiB) stays in the CPU's cache and comes from the
# heap. On the whole draw at once, every temporary (4 bytes a pair) is fresh memory: on a loaded machine the page
# faults and memory traffic cost twice the arithmetic (795k coordinates: 40 ms against 20 at load 10); in chunks of
# 2^12 pairs numpy's per-call cost shows (784k coordinates, CPU: 2^12 5.7 ms, 2^13 4.4 ms, 2^14 3.9 ms, 2^15 3.9 ms).
_CHUNK = 1 << 14

# A draw of at least this many pairs runs in two halves, the first on a second thread: numpy's Philox words and its
# ufuncs release the GIL, so the halves use two cores (the same values: each pair is a function of its index alone).
_PARALLEL_PAIRS = 1 << 17


def _chunks(n: int, key: int, scale: float, begin: int = 0, end: int | None = None):
    """(first pair, [2, m] ``scale``·normals) by chunks of :data:`_CHUNK` pairs from pair `begin` to `end` (the last):
    the core's ``scaled_normal`` under `key` value for value (pair j: x0 = word j, x1 = word P + j of stream 0,
    refined from stream 1 where x0 = 0)."""
    pairs = (n + 1) // 2
    end = pairs if end is None else end
    words = stream_key(key, 0)
    first, second = WordReader(words, begin), WordReader(words, pairs + begin)
    refinement = None  # stream 1: drawn only where a chunk has a pair with x0 == 0 (probability 2^-32 a pair)
    for start in range(begin, end, _CHUNK):
        size = min(_CHUNK, end - start)
        x0, x1 = first.read(size), second.read(size)
        extra = ()
        if not x0.all():
            if refinement is None:
                refinement = NOISE_OPS.random_words(key, (2, pairs), 1)
            extra = (refinement[0, start : start + size], refinement[1, start : start + size])
        yield start, scaled_pairs(NOISE_OPS, x0, x1, scale, *extra)


def _in_halves(pairs: int, work) -> None:
    """``work(begin, end)`` over the pairs [0, `pairs`): a large draw in two halves (split on a chunk boundary),
    the first on a second thread, joined before this returns (its error raised here)."""
    if pairs < _PARALLEL_PAIRS:
        work(0, pairs)
        return
    middle = pairs // 2 // _CHUNK * _CHUNK
    errors: list = []

    def first_half():
        try:
            work(0, middle)
        except BaseException as err:  # raised in the caller's thread
            errors.append(err)

    thread = threading.Thread(target=first_half, name="keras_dpsgd-noise", daemon=True)
    thread.start()
    try:
        work(middle, pairs)
    finally:
        thread.join()
    if errors:
        raise errors[0]


def _normal(n: int, key: int, scale: float, halves: bool = True) -> torch.Tensor:
    """float32 [n]: ``scale``·N(0, I_n) under `key` (:func:`_chunks` written into one buffer; a large draw in two
    halves on two threads unless `halves` is False)."""
    pairs = (n + 1) // 2
    buffer = torch.empty(2 * pairs, dtype=torch.float32)
    grid = buffer.numpy().reshape(2, pairs)

    def write(begin: int, end: int) -> None:
        for start, values in _chunks(n, key, scale, begin, end):
            grid[:, start : start + values.shape[1]] = values

    if halves:
        _in_halves(pairs, write)
    else:
        write(0, pairs)
    return buffer[:n]


def spare_core(device: str = "cpu") -> bool:
    """Whether a draw ahead has a CPU core to itself beside a step computing on `device` (a ``torch.device`` type).

    On an accelerator the step's math runs there: the CPU is free. On the CPU, only where torch's intra-op threads
    are fewer than the usable cores: with as many (torch's default), a second Python thread drawing noise shares the
    cores with torch's pool, whose OpenMP workers spin between operations, and with the step's Python for the GIL,
    and costs the step more than a draw at the release in two halves while the pool is idle.
    """
    if device != "cpu":
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class NoiseAhead:
    """A release's noise drawn on a second thread while the step computes its clipped sum.

    The noise of a release is a function of its keys, sizes and scales alone (``scale``·N(0, I) under a key): a
    caller that knows them before reading any example (the keys of the release's ledger position or its OS-entropy
    count, the scales σ·C of the bounds in force) starts them here, and :meth:`take` hands each draw over once,
    only for the same (key, size, scale): the same values as a draw at the release. A draw not taken (the step
    refused, or the release asked for another key) is dropped with this object, never used for another release.
    """

    def __init__(self, draws: dict):
        self._draws = dict(draws)  # index -> (key, n, scale)
        self._noise: dict = {}
        self._thread = threading.Thread(target=self._run, name="keras_dpsgd-noise-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index, (key, n, scale) in self._draws.items():
                self._noise[index] = _normal(n, key, scale, halves=False)
        except Exception:  # an error leaves the draw to the release, which raises it again
            self._noise.clear()

    def take(self, index: int, key: int, n: int, scale: float) -> torch.Tensor | None:
        """The draw of `index` if it was started for this (key, size, scale), else None; each draw once."""
        self._thread.join()
        if self._draws.pop(index, None) != (key, n, scale):
            return None
        return self._noise.pop(index, None)

    def close(self) -> None:
        """Waits for the thread and drops what was not taken."""
        self._thread.join()
        self._draws.clear()
        self._noise.clear()


def standard_normal(shape, key: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """N(0, 1) samples of `shape`, a function of `key` (computed in float32)."""
    shape = tuple(int(s) for s in shape)
    z = _normal(math.prod(shape), key, 1.0) if math.prod(shape) else torch.zeros(0)
    return z.reshape(shape).to(device=device or "cpu", dtype=dtype)


def add_gaussian(x: torch.Tensor, stddev, key: int, in_place: bool = False) -> torch.Tensor:
    """``x + N(0, stddev² I)`` with the scale folded into the radius (float32 noise).

    With `in_place` (a tensor the caller owns) a contiguous float32 CPU `x` gets the noise added chunk by chunk, with
    no buffer of the whole draw (the same values: float32 additions of the same noise).
    """
    if x.numel() == 0:
        return x
    if in_place and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
        flat = x.detach().view(-1).numpy()
        n, pairs = flat.size, (flat.size + 1) // 2

        def add(begin: int, last: int) -> None:  # the halves write disjoint entries
            for start, values in _chunks(n, key, float(stddev), begin, last):
                end = start + values.shape[1]
                flat[start:end] += values[0]
                flat[pairs + start : min(n, pairs + end)] += values[1][: min(n, pairs + end) - pairs - start]

        _in_halves(pairs, add)
        return x
    noise = _normal(x.numel(), key, float(stddev)).reshape(x.shape)
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return noise.add_(x)
    return x + noise.to(x.device).to(x.dtype)
