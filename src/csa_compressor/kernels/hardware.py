"""Facts of the SMs the kernels run on (sm_90 and sm_100 alike) and the occupancy
arithmetic built on them."""

from __future__ import annotations

import functools
import os
import re

import torch

SMEM_PER_SM = 228 * 1024  # shared memory of an SM
SMEM_RESERVED_PER_CTA = 1024  # what the driver reserves a CTA (ncu "Driver Shared Memory Per Block")
# Register file: 64K 32-bit registers in 4 partitions (one a scheduler), given to warps in
# units of 256.
REGS_PER_SM = 65536
REG_PARTITIONS = 4
REG_ALLOC_UNIT = 256
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32


def ctas_fitting_registers(regs: int, threads: int) -> int:
    """CTAs of ``threads`` threads at ``regs`` registers a thread that one SM holds by its
    registers and threads. Whole warps a partition: never more than the whole-SM count,
    so a grid sized by it is one wave."""
    warps = -(-threads // 32)
    per_warp = -(-regs * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    warps_by_regs = REGS_PER_SM // REG_PARTITIONS // per_warp * REG_PARTITIONS
    return min(min(warps_by_regs, MAX_THREADS_PER_SM // 32) // warps, MAX_CTAS_PER_SM)


def ctas_fitting_smem(smem_bytes: int) -> int:
    """CTAs of ``smem_bytes`` of shared memory one SM holds."""
    return SMEM_PER_SM // (smem_bytes + SMEM_RESERVED_PER_CTA)


def carveout_for(ctas: int, smem_bytes: int) -> int:
    """The shared-memory carveout (percent) that holds ``ctas`` CTAs of ``smem_bytes``."""
    need = ctas * (smem_bytes + SMEM_RESERVED_PER_CTA)
    return min(100, -(-need * 100 // SMEM_PER_SM))


def target_arch() -> str:
    """The architecture the DSL compiles for, as a name (the disk cache's key): its
    CUTE_DSL_ARCH override, else the current device's compute capability."""
    if os.environ.get("CUTE_DSL_ARCH"):
        return os.environ["CUTE_DSL_ARCH"]
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def target_major() -> int:
    """Compute-capability major the DSL compiles for: its CUTE_DSL_ARCH override (sm_90a,
    sm_100a: the compile-only checks), else the current device's."""
    digits = re.search(r"sm_(\d+)", os.environ.get("CUTE_DSL_ARCH", ""))
    if digits:
        return int(digits.group(1)) // 10
    return torch.cuda.get_device_capability()[0]


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def threads_per_sm(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).max_threads_per_multi_processor
