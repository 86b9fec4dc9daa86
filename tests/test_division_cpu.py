"""The kernels' division (ptx.div_by_rcp) replayed in exact rational arithmetic: one
correctly rounded reciprocal shared by all numerators, a product and one FMA residual
correction must give the IEEE quotient for every numerator the fast path accepts,
including quotients next to a rounding midpoint divided by the denominators whose
reciprocal is least accurate (where ``a*y`` is not faithful)."""

import math
import random
import struct
from fractions import Fraction

import pytest

from csa_compressor.kernels.softmax import DIV_FAST_MIN


def rn32(x: Fraction) -> Fraction:
    """Round a rational to the nearest float32 (ties to even), subnormals included."""
    if x == 0:
        return Fraction(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    e = max(e, -126)
    ulp = Fraction(2) ** (e - 23)
    q = x / ulp
    n, rem = divmod(q.numerator, q.denominator)
    rem = Fraction(rem, q.denominator)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2):
        n += 1
    return sign * n * ulp


def f32(v: float) -> Fraction:
    return Fraction(struct.unpack("f", struct.pack("f", v))[0])


def kernel_division(a: Fraction, b: Fraction) -> Fraction:
    y = rn32(1 / b)  # rcp.rn.f32
    q = rn32(a * y)  # mul.rn.f32
    r = rn32(a - b * q)  # fma.rn.f32 r, -b, q, a
    return rn32(q + r * y)  # fma.rn.f32 q, r, y, q


def test_rn32_matches_the_hardware_rounding_of_doubles():
    random.seed(0)
    for _ in range(2000):
        v = random.uniform(-10, 10) * 2.0 ** random.randint(-140, 100)
        assert rn32(Fraction(v)) == f32(v)


@pytest.mark.parametrize("den_max", [16, 256, 2.0 ** 20])  # short, ratio-128, huge windows
def test_shared_reciprocal_division_is_correctly_rounded(den_max):
    random.seed(den_max)
    dens = [f32(1.0), f32(2.0), f32(16.0), f32(1 + 2.0 ** -23), f32(2 - 2.0 ** -22), f32(3.0)]
    dens += [f32(random.uniform(1, den_max)) for _ in range(300)]
    nums = [f32(1.0), f32(DIV_FAST_MIN), f32(0.5 + 2.0 ** -24), f32(1 - 2.0 ** -24)]
    nums += [f32(2.0 ** random.uniform(math.log2(DIV_FAST_MIN), 0)) for _ in range(12)]
    nums += [f32(random.random()) for _ in range(12)]
    for b in dens:
        for a in nums:
            if a >= Fraction(DIV_FAST_MIN):
                assert kernel_division(a, b) == rn32(a / b), (float(a), float(b))


def ulp32(x: Fraction) -> Fraction:
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    return Fraction(2) ** (max(e, -126) - 23)


def test_division_next_to_rounding_midpoints():
    """The hard cases for one correction: a/b within an ulp's fraction of a midpoint
    between two floats, with b among the denominators whose rcp.rn is nearly half an ulp
    off (so a*y can be 1.5 ulp off and not faithful). Off-line, 600,000 such quotients
    (24,000 of them with an unfaithful a*y) all came out correctly rounded."""
    rng = random.Random(1)
    dens = []
    while len(dens) < 40:
        b = f32(rng.uniform(1, 2) * 2.0 ** rng.randint(0, 20))
        if abs(rn32(1 / b) - 1 / b) > Fraction(45, 100) * ulp32(1 / b):
            dens.append(b)
    unfaithful = 0
    for _ in range(1500):
        b = rng.choice(dens)
        k = rng.randint(2 ** 23, 2 ** 24 - 1)
        mid = (Fraction(k) + Fraction(1, 2)) * Fraction(2) ** (rng.randint(-60, -1) - 23)
        a0 = rn32(mid * b)
        for a in (a0, a0 + ulp32(a0), a0 - ulp32(a0)):
            if not Fraction(DIV_FAST_MIN) <= a <= 1:
                continue
            unfaithful += abs(rn32(a * rn32(1 / b)) - a / b) > ulp32(a / b)
            assert kernel_division(a, b) == rn32(a / b), (float(a), float(b))
    assert unfaithful > 0  # the hard regime was reached
