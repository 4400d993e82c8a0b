"""IBM float (SEG-Y format 1) -> IEEE float32: exact for every word, bit for bit what ``ibm2ieee`` gives.

The reference is the ``ibm2ieee`` package (its values kept in tests/data, see
``support.ibm_words``), plus values worked out by hand, so a converter that agrees with ibm2ieee on
ordinary samples but not on the edge cases still fails.
"""

from __future__ import annotations

import numpy as np
import segyio
import segyio._segyio  # noqa: F401  (segyio.tools.native needs the extension loaded)

from sfm.formats.segy_traces import _ibm_to_float32
from support.ibm_words import edge_words, ibm2ieee_float32, moderate_words, random_words



def convert(words) -> np.ndarray:
    """sfm's converter on IBM words given as integers (the converter takes big-endian bytes)."""
    words = np.asarray(words, dtype=np.uint32)
    return _ibm_to_float32(words.astype(">u4").view(np.float32).copy())


def bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def word(sign: int, exponent: int, fraction: int) -> int:
    return (sign << 31) | (exponent << 24) | fraction


def equals_ibm2ieee(name: str, words: np.ndarray) -> bool:
    return np.array_equal(bits(convert(words)), bits(ibm2ieee_float32(name, words)))


def test_every_exponent_and_edge_fraction_equals_ibm2ieee():
    assert equals_ibm2ieee("edge", edge_words())


def test_random_words_equal_ibm2ieee_bit_for_bit():
    assert equals_ibm2ieee("random", random_words())


def test_moderate_exponents_with_any_fraction_equal_ibm2ieee():
    sets = moderate_words()  # exponents 39-96: the converter's fast path, then +-0 words, then one word outside
    fraction = sets["moderate"] & 0xFFFFFF
    assert (fraction == 0).any() and (fraction < 1 << 20).mean() > 0.5
    for name, words in sets.items():
        assert equals_ibm2ieee(name, words), name


def test_unnormalised_fractions_decode_to_their_value():
    # 1/16 written four ways: normalised, and with one, two and five leading zero hex digits
    words = [word(0, 64, 0x100000), word(0, 65, 0x010000), word(0, 66, 0x001000), word(1, 69, 0x000001)]
    assert list(convert(words)) == [0.0625, 0.0625, 0.0625, -0.0625]
    assert convert([word(0, 0x47, 0x00374C)])[0] == 0x374C * 16.0 ** 7 / 2**24  # segyio reads this 37x too large


def test_zero_with_any_exponent_keeps_its_sign():
    out = convert([word(0, 0, 0), word(1, 0, 0), word(0, 0x7F, 0), word(1, 0x41, 0)])
    assert list(bits(out)) == [0, 0x80000000, 0, 0x80000000]


def test_denormal_range_rounds_half_to_even():
    tiny = 2.0 ** -149  # the smallest float32 denormal
    # exponent 32: value = F * 2^-152 = F/8 tiny: ties 0.5, 1.5, 2.5, 3.5 go to the even 0, 2, 2, 4;
    # 0.625 and 0.875 to 1
    out = convert([word(0, 32, f) for f in (4, 12, 20, 28, 5, 7)] + [word(1, 32, 12)])
    assert list(out.astype(np.float64) / tiny) == [0, 2, 2, 4, 1, 1, -2]
    smallest_normal = convert([word(0, 33, 0x040000)])[0]  # 2^18 * 2^-24 * 16^-31 = 2^-130: denormal
    assert smallest_normal == np.float32(2.0 ** -130) and smallest_normal < np.finfo(np.float32).tiny
    assert convert([word(0, 0, 1)])[0] == 0.0  # 2^-280: underflows to zero


def test_extreme_exponents():
    out = convert([word(0, 0x60, 0xFFFFFF), word(0, 0x61, 0x000001), word(0, 0x61, 0x100000), word(1, 0x7F, 0xFFFFFF)])
    assert out[0] == np.finfo(np.float32).max  # (1 - 2^-24) * 2^128: the largest float32, exactly
    assert out[1] == np.float32(2.0 ** 108)  # unnormalised, so a large exponent still fits
    assert out[2] == np.inf and out[3] == -np.inf  # beyond float32's range, as ibm2ieee gives


def test_normalised_samples_equal_segyio():
    rng = np.random.default_rng(1)
    n = 1 << 16
    sign = rng.integers(0, 2, n, dtype=np.uint32)
    exponent = rng.integers(40, 97, n, dtype=np.uint32)  # float32's normal range
    fraction = rng.integers(1 << 20, 1 << 24, n, dtype=np.uint32)  # first hex digit non-zero
    words = sign << 31 | exponent << 24 | fraction
    ref = segyio.tools.native(words.astype(">u4").view(np.float32).copy(), format=1, copy=False)
    assert np.array_equal(bits(convert(words)), bits(ref))
