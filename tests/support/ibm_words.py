"""IBM float words (SEG-Y format 1) the IBM tests convert, and ibm2ieee's float32 values of them.

``ibm2ieee`` (the reference the issue names) is not installed with the tests: its newest wheels
(1.3.3) are built for numpy 1 and do not import beside numpy 2, and building it needs a C compiler.
Its values are kept in ``tests/data/ibm2ieee_reference.npz``, written by
``python tests/support/ibm_words.py`` in an environment that has it::

    pip install --no-binary ibm2ieee --no-build-isolation ibm2ieee && python tests/support/ibm_words.py

Each set is recorded with a digest of its words, so a set changed here without regenerating the
file fails the tests instead of comparing against stale values.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "ibm2ieee_reference.npz"


def edge_words() -> np.ndarray:
    """Every sign and exponent with fractions 0, 2^k - 1, 2^k, 2^k + 1 (unnormalised up to five leading
    zero hex digits), the largest fraction and random ones: [256 * 136] uint32."""
    fractions = {0, 0xFFFFFF}
    for k in range(24):
        fractions.update({(1 << k) - 1, 1 << k, (1 << k) + 1})
    fractions = np.array(sorted(f for f in fractions if f < 1 << 24), dtype=np.uint32)
    rng = np.random.default_rng(18)
    fractions = np.concatenate([fractions, rng.integers(0, 1 << 24, 64, dtype=np.uint32)])
    return (np.arange(256, dtype=np.uint32)[:, None] << 24 | fractions[None, :]).ravel()


def random_words(n: int = 1 << 15) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)


def moderate_words(n: int = 1 << 13) -> dict[str, np.ndarray]:
    """Exponents 39-96 only (the converter's fast path), zero fractions included; then with +-0 words
    among them; then with one word just outside the moderate exponents (the other path)."""
    rng = np.random.default_rng(2)
    fraction = rng.integers(0, 1 << 24, n, dtype=np.uint32) >> rng.integers(0, 24, n, dtype=np.uint32)
    words = rng.integers(0, 2, n, dtype=np.uint32) << 31 | rng.integers(39, 97, n, dtype=np.uint32) << 24 | fraction
    sets = {"moderate": words.copy()}
    words[::7] = 0  # +-0 with exponent 0, as muted samples are written
    words[::11] = 0x80000000
    sets["moderate_zeros"] = words.copy()
    for edge in (38, 97):
        words[5] = edge << 24 | 0x123456
        sets[f"moderate_edge{edge}"] = words.copy()
    return sets


def ingest_words(n_words: int = 3200, seed: int = 18) -> np.ndarray:
    """What the ingest test writes into a file: every sign and exponent with zero, unnormalised,
    normalised and extreme fractions, then random words."""
    fractions = np.array([0, 1, 0x7, 0x10, 0x100, 0xFFF, 0x10000, 0x0FFFFF, 0x100000, 0xFFFFFF], dtype=np.uint32)
    edges = (np.arange(256, dtype=np.uint32)[:, None] << 24 | fractions).ravel()
    rest = np.random.default_rng(seed).integers(0, 1 << 32, n_words - edges.size, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([edges, rest])


def word_sets() -> dict[str, np.ndarray]:
    return {"edge": edge_words(), "random": random_words(), **moderate_words(), "ingest": ingest_words()}


def _digest(words: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(words, dtype="<u4").tobytes()).hexdigest()


def ibm2ieee_float32(name: str, words: np.ndarray) -> np.ndarray:
    """ibm2ieee's float32 values of word set ``name`` (whose words must be ``words``), from the reference file."""
    with np.load(REFERENCE) as ref:
        assert str(ref[f"{name}_sha256"]) == _digest(words), (
            f"word set {name!r} changed since {REFERENCE.name} was written; regenerate it (see {__name__})")
        return ref[f"{name}_bits"].view(np.float32)


def main() -> None:
    import ibm2ieee

    out = {}
    for name, words in word_sets().items():
        out[f"{name}_sha256"] = np.array(_digest(words))
        out[f"{name}_bits"] = ibm2ieee.ibm2float32(words).view(np.uint32)
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(REFERENCE, **out)
    from importlib.metadata import version

    print(f"wrote {REFERENCE} with ibm2ieee {version('ibm2ieee')}: {', '.join(word_sets())}")


if __name__ == "__main__":
    main()
