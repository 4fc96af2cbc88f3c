"""Banded matrix factorization (BandMF): the strategy matrix and the correlated noise, pure numpy/scipy.

DP matrix factorization (Denisov et al. 2022; Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023) writes the workload A (the map from the
n clipped gradient sums G to what training uses of them: A = the lower-triangular matrix of ones for plain SGD,
whose parameters are prefix sums) as A = B C and releases B(C G + Z), Z ~ N(0, σ² clip² I). The same release,
step by step: the gradient sum of step t gets the noise w_t = (C⁻¹ Z)_t, i.e. C w = Z, so

    w_t = (z_t − Σ_{j=1}^{b−1} C[t, t−j] w_{t−j}) / C[t, t]                                   (1)

with the b − 1 last noise vectors kept (:func:`correlated_noise`). The noise of successive steps is correlated
and partly cancels in the prefix sums: the error of the parameters is ‖A C⁻¹‖_F² σ² clip² per coordinate,
against ‖A‖_F² σ² clip² for DP-SGD (C = I).

Here C is **banded Toeplitz**: C[i, j] = c_{i−j} for 0 <= i − j < b, else 0 (b bands, the simplest banded
strategy: b numbers, any number of steps, the recursion (1) the same at every step). The coefficients are
scaled so that ‖c‖₂ = 1: every column of C has norm at most ‖c‖ (the last b − 1 columns are truncated), so one
participation of an example moves C G by at most clip (the sensitivity the accountant needs, with
participations at least b steps apart: :mod:`keras_dpsgd.accounting.bandmf`). b = 1 is C = I: DP-SGD.

:func:`optimize_banded_toeplitz` chooses c for n steps minimizing ‖A C⁻¹‖_F² subject to ‖c‖ = 1 (scipy's
L-BFGS-B over c_1..c_{b−1} with c_0 = 1 and the scale divided out; started from the better of the identity and
the banded square root of the prefix-sum matrix), cached on disk by (n, b, workload).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from typing import Any, Optional, Sequence

import numpy as np
from scipy import linalg, optimize  # not scipy.signal: it imports array backends (torch, jax) when present

from keras_dpsgd import _validate as V

__all__ = [
    "BandedToeplitzStrategy",
    "add_correlated_noise",
    "correlated_noise",
    "default_cache_dir",
    "optimize_banded_toeplitz",
    "sgd_workload",
]

_CACHE_VERSION = 1
_MAX_DENSE_STEPS = 6000  # an explicit workload is an n × n matrix


def _check_coefficients(coefficients: Sequence[float]) -> tuple[float, ...]:
    if isinstance(coefficients, (str, bytes)):
        raise TypeError(f"coefficients must be a sequence of finite numbers, got {coefficients!r}")
    c = tuple(V.in_range(-math.inf, math.inf, "()", **{f"coefficients[{i}]": x}) for i, x in enumerate(coefficients))
    if not c:
        raise ValueError("coefficients must hold at least one number (b >= 1 bands), got an empty sequence")
    if c[0] <= 0.0:
        raise ValueError(f"coefficients[0] (the diagonal of C) must be > 0, got {c[0]!r}")
    return c


def _unit_float32(c: np.ndarray) -> tuple[float, ...]:
    """c / ‖c‖, rounded to float32 values (the numbers the float32 recursion multiplies by), as Python floats."""
    c = np.asarray(c, dtype=np.float64)
    return tuple(float(x) for x in (c / np.linalg.norm(c)).astype(np.float32))


@dataclasses.dataclass(frozen=True)
class BandedToeplitzStrategy:
    """A lower-triangular banded Toeplitz strategy C: C[i, j] = c_{i−j} for 0 <= i − j < b.

    Args:
      coefficients: c_0 > 0, c_1, ..., c_{b−1}: the diagonal and the b − 1 bands below it. Use
        :meth:`normalized` (or :func:`optimize_banded_toeplitz`) for ‖c‖ = 1.
      steps: n, the number of steps the coefficients were chosen for (the recursion runs for any number of
        steps; only the optimality is for n).

    Raises:
      ValueError, TypeError: a coefficient that is not a finite number, c_0 <= 0, no coefficient, steps < 1.
    """

    coefficients: tuple
    steps: int

    def __post_init__(self):
        object.__setattr__(self, "coefficients", _check_coefficients(self.coefficients))
        object.__setattr__(self, "steps", V.integer_at_least(1, steps=self.steps))

    @classmethod
    def identity(cls, steps: int) -> "BandedToeplitzStrategy":
        """C = I (b = 1): DP-SGD."""
        return cls((1.0,), steps)

    @classmethod
    def normalized(cls, coefficients: Sequence[float], steps: int) -> "BandedToeplitzStrategy":
        """The strategy with c / ‖c‖ (rounded to float32 values): column norms at most 1 (up to that rounding,
        which :attr:`column_norm` bounds)."""
        return cls(_unit_float32(_check_coefficients(coefficients)), steps)

    @property
    def bands(self) -> int:
        """b, the number of nonzero diagonals (the main one included)."""
        return len(self.coefficients)

    @property
    def column_norm(self) -> float:
        """An upper bound on max_j ‖C[:, j]‖₂ for every number of steps: ‖c‖₂, rounded up.

        The sensitivity of C G to one participation (per unit of clip); the accountant divides σ by it.
        """
        norm = math.sqrt(math.fsum(c * c for c in self.coefficients))
        return float(np.nextafter(np.nextafter(norm, math.inf), math.inf))  # ≥ the exact norm of these floats

    def matrix(self, steps: Optional[int] = None) -> np.ndarray:
        """C as a dense [n, n] float64 array (`steps` None: :attr:`steps`)."""
        n = self.steps if steps is None else V.integer_at_least(1, steps=steps)
        out = np.zeros((n, n))
        for k, c in enumerate(self.coefficients[:n]):
            out += np.diag(np.full(n - k, c), -k)
        return out

    def inverse_coefficients(self, steps: Optional[int] = None) -> np.ndarray:
        """d_0..d_{n−1}: C⁻¹ is the lower-triangular Toeplitz matrix of d (the power series of 1/c(x))."""
        n = self.steps if steps is None else V.integer_at_least(1, steps=steps)
        return _first_column_of_inverse(np.asarray(self.coefficients), n)

    def error(self, workload: Optional[np.ndarray] = None) -> float:
        """‖A C⁻¹‖_F²: the total noise variance of the workload per coordinate, per unit of σ·clip.

        Args:
          workload: A, an [n, n] array (None: prefix sums, the lower-triangular ones, over :attr:`steps`).
        """
        return _error(np.asarray(self.coefficients), self.steps, workload)


def _band_storage(c: np.ndarray, steps: int, *, transposed: bool) -> np.ndarray:
    """C (lower, b − 1 subdiagonals) or Cᵀ (upper) in LAPACK's band storage, for ``scipy.linalg.solve_banded``."""
    b = min(len(c), steps)
    ab = np.zeros((b, steps))
    for k in range(b):
        ab[b - 1 - k if transposed else k, :] = c[k]  # entries outside the matrix are not read
    return ab


def _first_column_of_inverse(c: np.ndarray, steps: int) -> np.ndarray:
    """d with C d = e_0: the coefficients of C⁻¹ (lower-triangular Toeplitz)."""
    b = min(len(c), steps)
    rhs = np.zeros(steps)
    rhs[0] = 1.0
    return linalg.solve_banded((b - 1, 0), _band_storage(c, steps, transposed=False), rhs, check_finite=False)


def _error(c: np.ndarray, steps: int, workload: Optional[np.ndarray]) -> float:
    """‖A C⁻¹‖_F² for Toeplitz C of coefficients c (not normalized)."""
    if workload is None:
        e = np.cumsum(_first_column_of_inverse(c, steps))  # A C⁻¹ is Toeplitz with coefficients cumsum(d)
        return float(np.sum((steps - np.arange(steps)) * e * e))
    # X = A C⁻¹ solves Cᵀ Xᵀ = Aᵀ, Cᵀ upper-triangular with b − 1 superdiagonals.
    b = min(len(c), steps)
    xt = linalg.solve_banded((0, b - 1), _band_storage(c, steps, transposed=True), workload.T, check_finite=False)
    return float(np.sum(xt * xt))


def _check_workload(workload: Any, steps: int) -> Optional[np.ndarray]:
    if workload is None:
        return None
    if steps > _MAX_DENSE_STEPS:
        raise ValueError(
            f"steps must be <= {_MAX_DENSE_STEPS} with an explicit workload matrix (it is n × n), got {steps}"
        )
    a = np.asarray(workload, dtype=np.float64)
    if a.shape != (steps, steps) or not np.all(np.isfinite(a)):
        raise ValueError(f"workload must be a finite [{steps}, {steps}] matrix (steps × steps), got shape {a.shape}")
    return a


def sgd_workload(steps: int, *, momentum: float = 0.0, learning_rates: Optional[Sequence[float]] = None) -> np.ndarray:
    """A of Keras's SGD: row t maps the gradient sums to θ_{t+1} − θ_0 (up to sign).

    Keras's rule m_t = β m_{t−1} − η_t g_t, θ_{t+1} = θ_t + m_t gives A[t, s] = η_s (1 − β^{t−s+1}) / (1 − β)
    for s <= t (η_s (t − s + 1) at β = 0 with η = 1: the prefix sums, summed once more; pass None to
    :func:`optimize_banded_toeplitz` for plain prefix sums).

    Args:
      steps: n >= 1.
      momentum: β in [0, 1).
      learning_rates: η_0..η_{n−1} (None: 1 at every step).
    """
    n = V.integer_in_range(1, _MAX_DENSE_STEPS, steps=steps)
    beta = V.in_range(0, 1, "[)", momentum=momentum)
    eta = np.ones(n) if learning_rates is None else np.asarray(learning_rates, dtype=np.float64)
    if eta.shape != (n,) or not np.all(np.isfinite(eta)):
        raise ValueError(f"learning_rates must be {n} finite numbers (one per step), got shape {eta.shape}")
    lag = np.subtract.outer(np.arange(n), np.arange(n)).astype(np.float64)
    lag = np.maximum(lag, -1.0)  # -1 above the diagonal: weight 0 below
    weights = (1.0 - beta ** (lag + 1.0)) / (1.0 - beta) if beta else lag + 1.0
    return weights * eta[None, :]


def default_cache_dir() -> str:
    """Where optimized strategies are kept: $XDG_CACHE_HOME (else ~/.cache) / keras_dpsgd / bandmf."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "keras_dpsgd", "bandmf")


def _cache_path(cache_dir: str, steps: int, bands: int, workload: Optional[np.ndarray]) -> str:
    tag = "prefix" if workload is None else hashlib.sha256(np.ascontiguousarray(workload).tobytes()).hexdigest()[:16]
    return os.path.join(cache_dir, f"toeplitz_v{_CACHE_VERSION}_n{steps}_b{bands}_{tag}.json")


def _read_cache(path: str, bands: int) -> Optional[tuple[float, ...]]:
    """The cached coefficients, or None for a missing or malformed file (recomputed, never trusted blindly:
    the strategy is normalized again after loading, so a file can change the error but never the sensitivity)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        c = _check_coefficients(data["coefficients"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return c if len(c) == bands else None


def _write_cache(path: str, coefficients: tuple[float, ...]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"coefficients": list(coefficients)}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the optimization next time


def _banded_square_root(bands: int) -> np.ndarray:
    """The first b coefficients of (1 − x)^(−1/2): the square root of the prefix-sum matrix, banded."""
    r = np.ones(bands)
    for k in range(1, bands):
        r[k] = r[k - 1] * (2 * k - 1) / (2 * k)
    return r


def _optimize(steps: int, bands: int, workload: Optional[np.ndarray]) -> np.ndarray:
    def objective(theta: np.ndarray) -> float:
        c = np.concatenate([[1.0], theta])
        with np.errstate(all="ignore"):
            value = float(np.dot(c, c)) * _error(c, steps, workload)  # ‖A (C/‖c‖)⁻¹‖² = ‖c‖² ‖A C⁻¹‖²
        return math.log(value) if np.isfinite(value) and value > 0 else 1e30

    starts = [np.zeros(bands - 1), _banded_square_root(bands)[1:]]
    best = min(starts, key=objective)
    result = optimize.minimize(objective, best, method="L-BFGS-B", options={"maxiter": 500})
    theta = result.x if objective(result.x) <= objective(best) else best
    return np.concatenate([[1.0], theta])


def optimize_banded_toeplitz(
    steps: int, bands: int, *, workload: Any = None, cache_dir: Optional[str] = "auto"
) -> BandedToeplitzStrategy:
    """The banded Toeplitz strategy of `bands` bands minimizing ‖A C⁻¹‖_F² over `steps` steps, ‖c‖ = 1.

    Args:
      steps: n >= 1, the steps of the run (the workload's size).
      bands: b in [1, n]; 1 gives C = I (DP-SGD). Participations of an example must be at least b steps apart
        (:class:`keras_dpsgd.CyclicPoissonLots`), and amplification is charged over ⌈n/b⌉ rounds.
      workload: A, an [n, n] matrix (e.g. :func:`sgd_workload` with momentum and a learning-rate schedule);
        None: prefix sums (plain SGD at a constant learning rate).
      cache_dir: where the result is kept and looked up ("auto": :func:`default_cache_dir`; None: no cache).

    Returns:
      The normalized strategy (:meth:`BandedToeplitzStrategy.normalized`).

    Raises:
      ValueError: `steps` < 1, `bands` outside [1, steps], a workload of the wrong shape.
    """
    n = V.integer_at_least(1, steps=steps)
    b = V.integer_in_range(1, n, bands=bands)
    a = _check_workload(workload, n)
    if b == 1:
        return BandedToeplitzStrategy.identity(n)
    path = None
    if cache_dir is not None:
        path = _cache_path(default_cache_dir() if cache_dir == "auto" else os.fspath(cache_dir), n, b, a)
        cached = _read_cache(path, b)
        if cached is not None:
            return BandedToeplitzStrategy.normalized(cached, n)
    strategy = BandedToeplitzStrategy.normalized(_optimize(n, b, a), n)
    if path is not None:
        _write_cache(path, strategy.coefficients)
    return strategy


def correlated_noise(z: Any, history: Sequence[Any], coefficients: Sequence[float]) -> tuple[Any, list]:
    """One step of the recursion (1): w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0, over Python operators.

    Written once for numpy arrays and every backend's tensors (the coefficients are Python floats).

    Args:
      z: this step's fresh Gaussian draw (already scaled by σ·clip, or not: the map is linear).
      history: [w_{t−1}, ..., w_{t−b+1}] (zeros before the first step), b − 1 arrays shaped like `z`.
      coefficients: c_0..c_{b−1} of the strategy.

    Returns:
      (w_t, the new history [w_t, w_{t−1}, ..., w_{t−b+2}]). With b = 1 and c_0 = 1, w_t is z itself (bit for bit).
    """
    if len(history) != len(coefficients) - 1:
        raise ValueError(f"history must hold b - 1 = {len(coefficients) - 1} past draws, got {len(history)}")
    acc = z
    for c, past in zip(coefficients[1:], history):
        acc = acc - c * past
    w = acc / coefficients[0]
    return w, ([w] + list(history[:-1])) if history else []


def add_correlated_noise(
    sums: Sequence[Any], draws: Sequence[Any], history: Sequence[Sequence[Any]], coefficients: Sequence[float]
) -> tuple[list, list]:
    """BandMF's step 4 on every variable: its clipped sum plus w_t, the recursion (1) on its fresh draw z_t.

    The one implementation every front end runs (Keras 3 on TensorFlow in its optimizer's ``add_noise``, on JAX
    in its train step), over Python operators on the backend's arrays.

    Args:
      sums: the clipped sums Σ_i clip(g_i), one per variable.
      draws: z_t of each variable: DP-SGD's own draw N(0, σ² C_clip²) (so b = 1 adds DP-SGD's noise, bit for bit).
      history: ``history[j][v]`` = w_{t−1−j} of variable v, for j < b − 1 (zeros before the first step).
      coefficients: c_0..c_{b−1} of the strategy.

    Returns:
      (the released sums, the new history in the layout of `history`).
    """
    released, new_history = [], [[None] * len(sums) for _ in history]
    for v, (s, z) in enumerate(zip(sums, draws)):
        w, new = correlated_noise(z, [row[v] for row in history], coefficients)
        for j, value in enumerate(new):
            new_history[j][v] = value
        released.append(s + w)
    return released, new_history
