"""Hadamard and random orthogonal matrices, float64: the rotations of ``tools.convert`` (QuaRot / SpinQuant folded
into the weights) and of the fp8 KV cache (keys rotated per head before they are quantized,
:mod:`lqe.layers.attention`). Hadamard matrices come from Sylvester doubling, Paley I/II and Kronecker products,
which reach every head dimension in use (64, 80, 96, 128, 256, ...)."""
from __future__ import annotations

import math
from functools import lru_cache

import torch

ROTATIONS = ("hadamard", "orthogonal")


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, int(math.isqrt(p)) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = chi(j - i)`` with chi the quadratic character mod the prime ``q``."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if d in squares else -1 for d in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` from Paley's constructions (I: ``n = q + 1``, q prime = 3 mod 4; II:
    ``n = 2 (q + 1)``, q prime = 1 mod 4), or None."""
    q = n - 1
    if _is_prime(q) and q % 4 == 3:
        s = torch.zeros(n, n, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return s + torch.eye(n, dtype=torch.float64)
    q = n // 2 - 1
    if n % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
        a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


@lru_cache(maxsize=None)
def _hadamard(n: int) -> torch.Tensor | None:
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if n % 4:
        return None
    half = _hadamard(n // 2)
    if half is not None:  # Sylvester doubling
        return torch.kron(_hadamard(2), half)
    base = _paley(n)
    if base is not None:
        if not torch.equal(base @ base.t(), n * torch.eye(n, dtype=torch.float64)):
            raise AssertionError(f"internal error: the Paley matrix of order {n} is not a Hadamard matrix")
        return base
    for d in [d for d in range(4, n // 4 + 1) if n % d == 0]:  # Kronecker products
        left, right = _hadamard(d), _hadamard(n // d)
        if left is not None and right is not None:
            return torch.kron(left, right)
    return None


def hadamard(n: int) -> torch.Tensor:
    """An ``n x n`` Hadamard matrix (entries +-1, ``H H^T = n I``), float64, built from Sylvester doubling, Paley
    I/II and Kronecker products; ValueError when none of those reaches ``n``."""
    h = _hadamard(n)
    if h is None:
        raise ValueError(f"no Hadamard matrix of order {n} from Sylvester/Paley constructions")
    return h.clone()  # Kronecker products of Hadamard matrices are Hadamard: only the Paley bases need checking


def rotation_matrix(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal ``[n, n]`` float64: ``hadamard`` = ``diag(random signs) H / sqrt(n)`` (QuaRot's randomized
    Hadamard), ``orthogonal`` = Q of the QR of a Gaussian matrix (signs fixed so it is Haar-distributed)."""
    if kind == "hadamard":
        h = signed_hadamard(n, seed)
        if h is None:
            hadamard(n)  # raises the ValueError that names n
        return h / math.sqrt(n)
    gen = torch.Generator().manual_seed(seed)
    if kind == "orthogonal":
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :]
    raise ValueError(f"unknown rotation {kind!r}; choose one of {ROTATIONS}")


def signed_hadamard(n: int, seed: int = 0) -> torch.Tensor | None:
    """``diag(s) H`` with random signs ``s`` (seeded): a ``+-1`` matrix with ``M M^T = n I``, exact in every float
    dtype, or None when no Hadamard matrix of order ``n`` is known."""
    h = _hadamard(n)
    if h is None:
        return None
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return signs[:, None] * h
