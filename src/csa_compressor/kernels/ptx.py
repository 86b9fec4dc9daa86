"""Inline-PTX primitives whose rounding the compiler must not change (no contraction into
FMAs, no speculation), and exact bf16 widening."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm_f32(text, constraints, *args, volatile=False, operand=Float32, loc=None,
             ip=None) -> Float32:
    """One fp32 result from inline PTX on ``operand``-typed inputs. ``volatile`` keeps the
    compiler from speculating or moving it (e.g. out of a rarely taken branch)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [operand(a).ir_value(loc=loc, ip=ip) for a in args],
            text,
            constraints,
            has_side_effects=volatile,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """fp32 product rounded on its own: inline PTX, so it can never be contracted into an
    FMA with the add that follows (the reference rounds the product before adding)."""
    return _asm_f32("mul.rn.f32 $0, $1, $2;", "=f,f,f", a, b, loc=loc, ip=ip)


@dsl_user_op
def sub_mul_rn(x, p, s, *, loc=None, ip=None) -> Float32:
    """``x - p*s`` with one rounding (a fused multiply-add, pinned): torch's CUDA softmax
    backward computes ``dscore = grad*out - out*sum`` as exactly this FMA."""
    return _asm_f32("{\n.reg .f32 n;\nneg.f32 n, $2;\nfma.rn.f32 $0, n, $3, $1;\n}",
                    "=f,f,f,f", x, p, s, loc=loc, ip=ip)


@dsl_user_op
def max_nan(a, b, *, loc=None, ip=None) -> Float32:
    """NaN-propagating max in one instruction (``torch.amax`` semantics; the generic max
    lowers to two compares and a select)."""
    return _asm_f32("max.NaN.f32 $0, $1, $2;", "=f,f,f", a, b, loc=loc, ip=ip)


@dsl_user_op
def min_nan(a, b, *, loc=None, ip=None) -> Float32:
    return _asm_f32("min.NaN.f32 $0, $1, $2;", "=f,f,f", a, b, loc=loc, ip=ip)


@dsl_user_op
def bf16_lo(w, *, loc=None, ip=None) -> Float32:
    """The bf16 in the low half of a 32-bit word, as fp32 (exact: its bits, shifted up)."""
    return _asm_f32("shl.b32 $0, $1, 16;", "=f,r", w, operand=Int32, loc=loc, ip=ip)


@dsl_user_op
def bf16_hi(w, *, loc=None, ip=None) -> Float32:
    """The bf16 in the high half of a 32-bit word, as fp32 (exact: the low half cleared)."""
    return _asm_f32("and.b32 $0, $1, 0xFFFF0000;", "=f,r", w, operand=Int32, loc=loc, ip=ip)


@dsl_user_op
def round_bf16(a, *, loc=None, ip=None) -> Float32:
    """``a`` rounded to bf16 (nearest even) and widened back: torch's ``.to(bfloat16)``."""
    return _asm_f32("{\n.reg .b16 h;\n.reg .b32 w;\ncvt.rn.bf16.f32 h, $1;\n"
                    "cvt.u32.u16 w, h;\nshl.b32 $0, w, 16;\n}", "=f,f", a, loc=loc, ip=ip)


@dsl_user_op
def round_f16(a, *, loc=None, ip=None) -> Float32:
    """``a`` rounded to fp16 (nearest even) and widened back: torch's ``.to(float16)``."""
    return _asm_f32("{\n.reg .b16 h;\ncvt.rn.f16.f32 h, $1;\ncvt.f32.f16 $0, h;\n}", "=f,f", a,
                    loc=loc, ip=ip)


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None) -> Int32:
    """``lo`` and ``hi`` rounded to bf16 (nearest even) in one instruction, as one 32-bit
    word: ``lo`` in the low half (bf16_lo reads it back), ``hi`` in the high half."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(a).ir_value(loc=loc, ip=ip) for a in (lo, hi)],
            "cvt.rn.bf16x2.f32 $0, $2, $1;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def round_bf16_pair(a, b):
    """``(round_bf16(a), round_bf16(b))`` in 3 instructions instead of 6."""
    w = pack_bf16x2(a, b)
    return bf16_lo(w), bf16_hi(w)


def rounder(dtype, numerics: str):
    """The rounding of an fp32 value to ``dtype`` that the ``"eager"`` numerics put after
    the softmax and after each product (None: ``"fp32"``, or an fp32 ``dtype``)."""
    if numerics == "fp32" or dtype.width == 32:
        return None
    return round_bf16 if dtype is cutlass.BFloat16 else round_f16


@cute.jit
def widen_bf16(src: cute.Tensor, vec: cutlass.Constexpr[int]):
    """A bf16 vector (even length) as a list of fp32 values, one instruction an element.
    The generic conversion extracts the high half first (PRMT, then a shift): three
    instructions a pair instead of two."""
    words = cute.recast_tensor(src, Int32).load()
    vals = []
    for i in cutlass.range_constexpr(vec // 2):
        vals.append(bf16_lo(words[i]))
        vals.append(bf16_hi(words[i]))
    return vals


@dsl_user_op
def rcp_rn(b, *, loc=None, ip=None) -> Float32:
    """IEEE reciprocal, correctly rounded (the compiler's full-range expansion)."""
    return _asm_f32("rcp.rn.f32 $0, $1;", "=f,f", b, loc=loc, ip=ip)


@dsl_user_op
def div_by_rcp(a, nb, y, *, loc=None, ip=None) -> Float32:
    """``a / b`` correctly rounded, given ``nb = -b`` and ``y = rcp_rn(b)``: ``q = a*y``
    (within 1.5 ulp of a/b), then one residual correction ``q += (a - b*q)*y`` with the
    residual exact under FMA. That is the fast path of the compiler's own ``div.rn.f32``
    (the same refined reciprocal, which is what ``rcp.rn.f32`` expands to, then the
    product and one FMA correction; its FCHK sends only exponent extremes to a slow path).
    Valid while nothing underflows: callers check ``a >= DIV_FAST_MIN``.
    tests/test_division_cpu.py replays it in exact arithmetic, also on quotients next to
    a rounding midpoint over the least accurate reciprocals (where ``a*y`` is not
    faithful). A second correction (Markstein's theorem needs a faithful ``q``) was the
    code before and cost 16 instructions a column of 8 slots."""
    return _asm_f32(
        "{\n.reg .f32 q, r;\nmul.rn.f32 q, $1, $3;\nfma.rn.f32 r, $2, q, $1;\n"
        "fma.rn.f32 $0, r, $3, q;\n}",
        "=f,f,f,f", a, nb, y, loc=loc, ip=ip)


@dsl_user_op
def div_exact(a, b, *, loc=None, ip=None) -> Float32:
    """IEEE division as an opaque (volatile) instruction: as a plain ``/`` the compiler
    speculates the whole division out of the rarely taken branch that needs it."""
    return _asm_f32("div.rn.f32 $0, $1, $2;", "=f,f,f", a, b, volatile=True, loc=loc, ip=ip)


@dsl_user_op
def rsqrt_approx(a, *, loc=None, ip=None) -> Float32:
    """``rsqrtf``: the approximate reciprocal square root torch.rsqrt runs on CUDA (not the
    DSL's math lowering, whose instruction and flush mode may differ)."""
    return _asm_f32("rsqrt.approx.f32 $0, $1;", "=f,f", a, loc=loc, ip=ip)


@dsl_user_op
def i64_to_f32(a, *, loc=None, ip=None) -> Float32:
    """A 64-bit integer to fp32, rounded to nearest (C++'s ``static_cast<float>``)."""
    return _asm_f32("cvt.rn.f32.s64 $0, $1;", "=f,l", a, operand=cutlass.Int64, loc=loc, ip=ip)
