"""A fixed 2-D scattering transform (Mallat 2012; Bruna & Mallat 2013) in NumPy, for benchmarks/mnist_cnn.py.

Tramèr & Boneh (2021) train DP models on ScatterNet features: a cascade of Morlet wavelet
convolutions, moduli and a Gaussian low-pass, with no learned weights. The transform depends on
nothing but its own constants (J scales, L orientations), so applying it to each image is a
public, per-example map: it costs no privacy. For 28×28 images, J = 2 and L = 8 it gives 81
channels (1 zeroth-order, J·L = 16 first-order, L²·J(J-1)/2 = 64 second-order) on a 7×7 grid.

This is our own implementation from the definitions (Morlet filters built in space and taken to
Fourier, periodic convolution on a reflect-padded 32×32 grid); it does not reproduce any library's
numbers bit for bit.
"""

from __future__ import annotations

import numpy as np
from scipy import fft as sfft

SIZE = 32  # the padded grid (28 + 2 × 2, reflect)


def _gabor(sigma: float, theta: float, xi: float, slant: float) -> tuple[np.ndarray, np.ndarray]:
    """(Gabor, its Gaussian envelope) on the SIZE×SIZE grid centred at 0 (periodic layout)."""
    u = np.fft.fftfreq(SIZE, 1.0 / SIZE)  # 0, 1, ..., -1: the periodic grid
    u1, u2 = np.meshgrid(u, u, indexing="ij")
    c, s = np.cos(theta), np.sin(theta)
    a, b = c * u1 + s * u2, -s * u1 + c * u2  # along / across the orientation
    envelope = np.exp(-(a**2 + (slant * b) ** 2) / (2 * sigma**2)) * slant / (2 * np.pi * sigma**2)
    return envelope * np.exp(1j * xi * a), envelope


def filters(J: int = 2, L: int = 8) -> tuple[np.ndarray, dict]:
    """(φ̂, {(j, l): ψ̂_{j,l}}) in Fourier: the low-pass at scale 2^J and the zero-mean Morlet wavelets."""
    _, phi = _gabor(0.8 * 2**J, 0.0, 0.0, 1.0)
    psi = {}
    for j in range(J):
        for ell in range(L):
            theta = np.pi * ell / L
            gabor, envelope = _gabor(0.8 * 2**j, theta, 3 * np.pi / 4 / 2**j, 4.0 / L)
            morlet = gabor - envelope * (gabor.sum() / envelope.sum())  # zero mean
            psi[(j, ell)] = np.fft.fft2(morlet)
    return np.fft.fft2(phi).real, psi


def scatter(images: np.ndarray, J: int = 2, L: int = 8, batch: int = 1000) -> np.ndarray:
    """Scattering coefficients of [N, 28, 28] (or [N, 28, 28, 1]) images: [N, 7, 7, 81] float32.

    Order 0: x ⋆ φ; order 1: |x ⋆ ψ_{j,l}| ⋆ φ; order 2: ||x ⋆ ψ_{j1,l1}| ⋆ ψ_{j2,l2}| ⋆ φ for j2 > j1;
    each low-passed map sampled every 2^J pixels of the unpadded image.
    """
    phi, psi = filters(J, L)
    phi = phi.astype(np.float32)
    psi = {k: v.astype(np.complex64) for k, v in psi.items()}
    step, pad = 2**J, (SIZE - images.shape[1]) // 2
    coarse = SIZE // step
    x = images.reshape(len(images), images.shape[1], images.shape[2]).astype(np.float32)
    fft2 = lambda a: sfft.fft2(a, workers=-1)  # noqa: E731
    ifft2 = lambda a: sfft.ifft2(a, workers=-1)  # noqa: E731
    out = []
    for start in range(0, len(x), batch):
        xb = np.pad(x[start : start + batch], ((0, 0), (pad, pad), (pad, pad)), mode="reflect")
        xf = fft2(xb)

        def low(f):
            """⋆ φ sampled every 2^J pixels of the padded grid (the spectrum folded onto the coarse
            grid: sampling in space is aliasing in frequency), the samples inside the image kept."""
            g = (f * phi).reshape(len(f), step, coarse, step, coarse).sum(axis=(1, 3)) / step**2
            return ifft2(g).real[:, 1:, 1:]

        maps = [low(xf)]
        second = []
        for (j1, _), p1 in psi.items():
            u1f = fft2(np.abs(ifft2(xf * p1)))
            maps.append(low(u1f))
            for (j2, _), p2 in psi.items():
                if j2 > j1:
                    second.append(low(fft2(np.abs(ifft2(u1f * p2)))))
        out.append(np.stack(maps + second, axis=-1).astype(np.float32))
    return np.concatenate(out)


def group_normalize(features: np.ndarray, groups: int = 27, eps: float = 1e-5) -> np.ndarray:
    """Each example's channels in `groups` groups, each group to zero mean and unit variance over its
    channels and positions (GroupNorm without its learned scale; per example, so no privacy cost)."""
    n, h, w, c = features.shape
    g = features.reshape(n, h, w, groups, c // groups)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    return ((g - mean) / np.sqrt(var + eps)).reshape(n, h, w, c).astype(np.float32)
