"""The window softmax of the register-resident kernels: serial max, exponentials, serial
sum and IEEE division, in torch's order."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .ptx import div_by_rcp, div_exact, max_nan, min_nan, mul_rn, rcp_rn, sub_mul_rn

# The smallest softmax numerator that takes the shared-reciprocal division: with
# denominators in [1, 2^40] every intermediate of the fast path stays a normal number from
# there up, so it is exact (tests/test_division_cpu.py); smaller ones take a true division.
DIV_FAST_MIN = 2.0 ** -64


@cute.jit
def column_min(sf: cute.Tensor, e: cutlass.Constexpr[int], slots: cutlass.Constexpr[int],
               mn=None):
    """The NaN-propagating minimum of column ``e``'s slots, continuing the running ``mn``
    of earlier columns when given (divide_columns' check)."""
    for k in cutlass.range_constexpr(slots):
        mn = sf[k, e] if mn is None else min_nan(mn, sf[k, e])
    return mn


@cute.jit
def divide_columns(sf: cute.Tensor, cols, slots: cutlass.Constexpr[int], dns, mn):
    """``sf[k, e] <- sf[k, e] / dns[i]`` for every slot of each column ``e = cols[i]``,
    bitwise the IEEE quotients, given ``mn``, the column_min over all their numerators:
    one shared reciprocal a column and 3 instructions a slot when every numerator is at
    least DIV_FAST_MIN, true divisions otherwise (tiny, zero or NaN numerators)."""
    if mn >= Float32(DIV_FAST_MIN):
        for i, e in enumerate(cols):
            y = rcp_rn(dns[i])
            nd = -dns[i]
            for k in cutlass.range_constexpr(slots):
                sf[k, e] = div_by_rcp(sf[k, e], nd, y)
    else:
        for i, e in enumerate(cols):
            for k in cutlass.range_constexpr(slots):
                sf[k, e] = div_exact(sf[k, e], dns[i])


@cute.jit
def divide_column(sf: cute.Tensor, e: cutlass.Constexpr[int], slots: cutlass.Constexpr[int], dn):
    """divide_columns of one column (one check a column)."""
    divide_columns(sf, [e], slots, [dn], column_min(sf, e, slots))


@cute.jit
def column_exp_sum(sf: cute.Tensor, e: cutlass.Constexpr[int], slots: cutlass.Constexpr[int],
                   fastmath: cutlass.Constexpr[bool] = False):
    """Column ``e`` of a register window: ``sf[k, e] <- exp(sf[k, e] - max)`` (serial
    NaN-propagating max), returning their serial sum."""
    mx = sf[0, e]
    for k in cutlass.range_constexpr(1, slots):
        mx = max_nan(mx, sf[k, e])
    for k in cutlass.range_constexpr(slots):
        sf[k, e] = cute.math.exp(sf[k, e] - mx, fastmath=fastmath)
    dn = sf[0, e]
    for k in cutlass.range_constexpr(1, slots):
        dn = dn + sf[k, e]
    return dn


@cute.jit
def softmax_row(sf: cute.Tensor, vec: cutlass.Constexpr[int], slots: cutlass.Constexpr[int]):
    """Every column ``e`` of a register window: ``sf[k, e] <- exp(sf[k, e] - max) / sum``,
    in the fp32 reference's order (serial max, serial sum, true division). The division
    is divide_columns over the whole row: every column's exponentials and sum first, then
    one branch to the shared-reciprocal path (exact when every numerator of
    the row is at least DIV_FAST_MIN) or to true divisions. Both paths give the IEEE
    quotients, so the result is bitwise what a check a column gives; without a branch
    between columns their chains interleave (a check a column was slower)."""
    dns = []
    mn = None
    for e in cutlass.range_constexpr(vec):
        dns.append(column_exp_sum(sf, e, slots))
        mn = column_min(sf, e, slots, mn)
    divide_columns(sf, list(range(vec)), slots, dns, mn)


# The softmax backward of one slot, as torch's CUDA kernels compute it (every backward
# kernel calls these two, so the algebra is written once): with dp = g * v,
# pdp = round(p * dp) (torch's grad_output * output), S the window sum of pdp, then
# dscore = fma(-p, S, pdp) and dkv = round(g * p). ``rnd`` (ptx.rounder; the "eager"
# numerics) is the input dtype's rounding where the eager region computes in that dtype:
# dp = rnd(g * v) (the product's gradient in the dtype) and dkv = g * rnd(p) (the weights
# rounded to the dtype before the product).

def p_times_dp(p, g, v, rnd=None):
    """``round(p * round(g * v))``, each product rounded on its own."""
    dp = mul_rn(g, v)
    return mul_rn(p, dp if rnd is None else rnd(dp))


def softmax_grads(p, pdp, S, g, rnd=None):
    """``(dscore, dkv)`` of a slot: ``fma(-p, S, pdp)`` and ``round(g * p)``, in that order."""
    return sub_mul_rn(pdp, p, S), mul_rn(g, p if rnd is None else rnd(p))


def pooled_product(v, p, rnd=None):
    """A slot's term of the output sum: ``round(v * p)``; with ``rnd``, the eager region's
    ``rnd(v * rnd(p))`` (weights and product in the input dtype)."""
    if rnd is None:
        return mul_rn(v, p)
    return rnd(mul_rn(v, rnd(p)))
