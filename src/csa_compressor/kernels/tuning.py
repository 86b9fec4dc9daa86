"""The tuned constants that shape the kernels, as one frozen, hashable value.

Every kernel is built from a ``Tuning`` and the compile cache keys on it, so a variant
(``replace(DEFAULT, FWD_STAGES=3)`` handed to the kernel-level API's ``tuning=``, or
``CSA_CONFIG="FWD_STAGES=3"`` in the environment for a whole process) compiles its own
kernels and can never reuse a stale one. The few values that only steer launches
(LAUNCH_ONLY) are read at launch from the caller's tuning and left out of the key, so
changing them recompiles nothing. Each value carries one line of why; the
measurements behind it are in docs/lab/tuning-log.md (the forward and shared values),
tuning-backward.md or tuning-long.md under its name.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, replace  # noqa: F401  (tuning.replace(t, ...))


@dataclass(frozen=True)
class Tuning:
    # --- shared by the register-resident kernels (windows of <= MAX_REG_SLOTS slots) ---
    MAX_REG_SLOTS: int = 16  # longer windows go to the slot-parallel kernels (pool_long)
    MAX_CTA_THREADS: int = 128  # column lanes of a CTA; wider rows split into column groups
    MIN_CHUNKS_PER_ROW: int = 32  # vectors shrink until one row fills a warp
    # --- forward (pool_fwd) ---
    VEC_BYTES: int = 8  # 8 B a thread a slot beat 4 and 16 at 3x8192/512
    FWD_MIN_CHUNKS_PER_ROW: int = 64  # halve the vector below 64 chunks a row: d=128 bf16 ran faster in 4 B
    FWD_MIN_VEC_BYTES: int = 4  # cp.async's smallest copy
    FWD_MAX_WINDOW_ELEMS: int = 40  # halve while a window holds more: d=512 ratios 6-8 coff 2 fit 4 CTAs an SM
    FWD_CTA_THREADS: int = 128  # row lanes stacked up to this; 128 beat 256
    FWD_STAGES: int = 2  # rows in flight through cp.async; 2 beat 3
    FWD_SMEM_PER_CTA: int = 48 * 1024  # staging budget a CTA (fewer stages past it, never below 2)
    FWD_TARGET_CTAS_PER_SM: int = 4  # one-wave grid; 2 was slower, 8 the same
    FWD_MAX_ROWS_PER_THREAD: int = 64  # cap on rows a thread walks
    # Narrow forwards (<= 4-byte vectors) held to this many CTAs an SM, per compute
    # capability major: one wave of one row a thread at 1x8192/128, spill-free.
    FWD_BOUND_CTAS_PER_SM: tuple = ((9, 8), (10, 7))
    FWD_BOUND_MAX_ELEMS: int = 16  # larger windows spilled under the bound
    # (ratio, coff, vector elements) that spilled under the bound, per architecture.
    FWD_BOUND_SPILLS: tuple = ((9, ((6, 1, 2),)), (10, ((8, 1, 2),)))
    # --- backward (pool_bwd) ---
    BWD_VEC_BYTES: int = 4  # three window-sized register arrays: narrower vectors, more threads
    BWD_FP32_VEC_BYTES: int = 8  # a bf16 thread's bytes a slot; kept to 4 where the staging fits no CTA
    BWD_CTA_THREADS: int = 256  # row lanes stacked up to this; their dape sums meet in shared memory
    BWD_TARGET_CTAS_PER_SM: int = 6  # what 80 registers x 128 threads leave resident at d=512
    BWD_STAGES: int = 3  # rows in flight; 3 beat 2, 4, 5 and 6
    BWD_LARGE_PACK_ROWS: int = 4096  # packs this large take the large-pack variant
    BWD_LARGE_GUESS_PACK_ROWS: int = 2048  # ... from here where that variant guesses its first row
    BWD_LARGE_MAX_DEFAULT_CTAS: int = 6  # a large-pack variant where the default runs 3 to this many CTAs
    # Most window slots a large-pack variant compiles spill-free at (CTAs an SM, slots).
    BWD_LARGE_MAX_SLOTS: tuple = ((2, 16), (3, 16), (4, 5), (5, 3))
    # Cooperative backwards: windows of more than `elems` elements a thread held to `most`
    # CTAs an SM, per coff ((elems, most), ...): more spilled at d=512.
    BWD_COOP_MAX_CTAS: tuple = ((1, ((20, 4), (16, 5))), (2, ((20, 4),)))
    ZERO_TOKENS_PER_THREAD: int = 32  # tokens a zero-fill thread walks after one search (2 made 25k CTAs)
    # --- long windows (pool_long) ---
    LONG_CTA_THREADS: int = 256  # forward CTA; 128 and 512 were slower
    LONG_SLOTS_PER_THREAD: int = 16  # forward slots a thread for windows of LONG_WIDE_MIN_SLOTS or more
    LONG_VEC_BYTES: int = 4  # 4-byte vectors: 48-80 registers, 3-5 CTAs an SM
    LONG_WIDE_MIN_SLOTS: int = 64  # narrower windows take LONG_NARROW_SLOTS_PER_THREAD
    LONG_NARROW_SLOTS_PER_THREAD: int = 8  # more slot groups a row: faster at ratio 16 coff 2
    LONG_BWD_CTA_THREADS: int = 256
    LONG_BWD_SLOTS_PER_THREAD: int = 16  # wide rows (>= LONG_BWD_MIN_COL_GROUPS CTAs a row)
    LONG_BWD_MIN_COL_GROUPS: int = 4  # fewer column groups: the narrow slot count
    LONG_BWD_VEC_BYTES: int = 4
    LONG_BWD_CTAS_PER_SM: int = 2  # register bound at 16 slots a thread
    LONG_BWD_NARROW_CTAS_PER_SM: int = 3  # at 8 slots, values in shared memory: 80 registers
    LONG_SUM_AHEAD: int = 8  # the serial sums' loads this many terms ahead of their adds
    # --- the dape partials' fixed-order sum (dape_reduce) ---
    REDUCE_COL_LANES: int = 8  # 16-byte vectors: 32 columns a CTA
    REDUCE_ROW_LANES: int = 64
    REDUCE_UNROLL: int = 4  # loads in flight a thread
    REDUCE_WIDE_MIN_CHUNKS: int = 4096  # partials this wide (ratio 128) also get the wide layout
    REDUCE_WIDE_MAX_ROWS: int = 32  # ... used up to this many partial rows (16 gained, 64 lost)
    REDUCE_WIDE_COL_LANES: int = 64
    REDUCE_WIDE_ROW_LANES: int = 8

    # --- what follows from the values ---

    def codegen(self) -> "Tuning":
        """This tuning with the launch-only values at their defaults: what a compiled kernel
        depends on, and so the compile cache's key. Made once a tuning (asked at every
        launch of the epilogue op; the replace cost ~17 µs of host time)."""
        got = self.__dict__.get("_codegen")
        if got is None:
            got = dataclasses.replace(self, **{k: getattr(DEFAULT, k) for k in LAUNCH_ONLY})
            object.__setattr__(self, "_codegen", got)
        return got

    def __hash__(self):
        # a key of the compile caches, hashed at every launch: once, not over every field
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(dataclasses.astuple(self))
            object.__setattr__(self, "_hash", h)
        return h

    def vector_elems(self, head_dim: int, elem_bytes: int, vec_bytes: int | None = None) -> int:
        """Elements a thread moves a slot: ``vec_bytes`` (VEC_BYTES) worth, halved until they
        divide head_dim and a row has MIN_CHUNKS_PER_ROW chunks (never below one)."""
        vec = max(1, (self.VEC_BYTES if vec_bytes is None else vec_bytes) // elem_bytes)
        while vec > 1 and (head_dim % vec or head_dim // vec < self.MIN_CHUNKS_PER_ROW):
            vec //= 2
        return vec

    def forward_vector_elems(self, head_dim: int, elem_bytes: int, slots: int = 0) -> int:
        """vector_elems, then halved while a row has fewer than FWD_MIN_CHUNKS_PER_ROW
        chunks, or a window of ``slots`` slots holds more than FWD_MAX_WINDOW_ELEMS elements
        a thread (where set), and the half is still FWD_MIN_VEC_BYTES or more."""
        vec = self.vector_elems(head_dim, elem_bytes)

        def wide(v):
            return (head_dim // v < self.FWD_MIN_CHUNKS_PER_ROW
                    or bool(self.FWD_MAX_WINDOW_ELEMS) and slots * v > self.FWD_MAX_WINDOW_ELEMS)

        while wide(vec) and vec % 2 == 0 and (vec // 2) * elem_bytes >= self.FWD_MIN_VEC_BYTES:
            vec //= 2
        return vec

    def long_window(self, num_slots: int) -> bool:
        return num_slots > self.MAX_REG_SLOTS

    @staticmethod
    def long_slots_per_thread(num_slots: int, most: int) -> int:
        return max(c for c in range(1, most + 1) if num_slots % c == 0)

    @staticmethod
    def dape_vector(cols: int) -> int:
        """Columns of one load in the dape sum: 16-byte loads where the columns allow."""
        return next(v for v in (4, 2, 1) if cols % v == 0)

    def dape_has_wide(self, cols: int) -> bool:
        """Whether partials of ``cols`` columns have the wide layout as well."""
        return cols // self.dape_vector(cols) >= self.REDUCE_WIDE_MIN_CHUNKS

    def fwd_bound_ctas(self, arch_major: int) -> int:
        return dict(self.FWD_BOUND_CTAS_PER_SM).get(arch_major, 0)

    def fwd_bound_spills(self, arch_major: int) -> tuple:
        return dict(self.FWD_BOUND_SPILLS).get(arch_major, ())

    def large_max_slots(self, ctas: int) -> int:
        return dict(self.BWD_LARGE_MAX_SLOTS)[ctas]

    def coop_max_ctas(self, coff: int) -> tuple:
        return dict(self.BWD_COOP_MAX_CTAS)[coff]


# Read at launch only (which compiled variant, rows a forward thread walks, which dape
# layout), never by the code a kernel compiles to.
LAUNCH_ONLY = ("BWD_LARGE_PACK_ROWS", "BWD_LARGE_GUESS_PACK_ROWS", "FWD_MAX_ROWS_PER_THREAD",
               "REDUCE_WIDE_MAX_ROWS")


def parse_overrides(spec: str) -> dict:
    """``"K=V,K=V"`` (the sweeps' notation) as {name: int}; unknown names raise."""
    fields = {f.name: f for f in dataclasses.fields(Tuning)}
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = item.partition("=")
        if key not in fields:
            raise KeyError(f"Tuning has no constant {key!r}")
        if fields[key].type != "int":
            raise KeyError(f"Tuning constant {key!r} is a table, not a sweep knob")
        out[key] = int(val)
    return out


DEFAULT = Tuning()
# The process's tuning: the defaults with CSA_CONFIG's overrides, read once at import. A
# caller that wants another hands a Tuning in (the kernel-level API's ``tuning=``, a
# Problem's ``tuning``): it is part of the compile key, never process-wide state.
ENV = dataclasses.replace(DEFAULT, **parse_overrides(os.environ.get("CSA_CONFIG", "")))


def current() -> Tuning:
    """The tuning kernels are built and launched with where the caller hands none in."""
    return ENV
