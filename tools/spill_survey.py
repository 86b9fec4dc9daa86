"""Compile a grid of kernel specialisations for sm_90a and sm_100a on this (CPU) machine and
list every one that spills, takes a stack frame or uses local memory, or whose grid is
sized for more CTAs an SM than its registers hold (hardware.ctas_fitting_registers). CI
checks the production configurations and the fixes this found (tests/test_compile_cpu.py);
this covers what users may ask for.

    python tools/spill_survey.py [--dtypes bfloat16,float32] [--dims 64,128,512]
        [--ratios 1-8] [--coffs 1,2] [--dirs fwd,bwd,bwd_large] [--archs sm_90a,sm_100a]
        [--jobs 2]

Each specialisation compiles in a subprocess (tests/compile_probe.py, ~4 s). ``bwd_large``
is compiled only where the backward has a large-pack variant. One JSON line a result, then
the offenders.
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=False, own_help=True)

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROBE = os.path.join(ROOT, "tests", "compile_probe.py")
sys.path.insert(0, os.path.join(ROOT, "src"))  # the package, for the tuning and the kernel shapes


def _ints(text):
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def probe(arch, cfg, overrides):
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CSA_CONFIG=overrides,
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, PROBE, *map(str, cfg)], env=env, capture_output=True,
                         text=True, timeout=900)
    if res.returncode:
        lines = [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]
        return {"error": " | ".join(lines[-4:]) or "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def has_large_variant(dtype, ratio, coff, d, arch):
    """Whether the backward at this specialisation has a large-pack variant (the kernel
    object's construction only; nothing is compiled)."""
    import cutlass

    from csa_compressor.kernels import tuning
    from csa_compressor.kernels.pool_bwd import PoolBackward

    if tuning.current().long_window(coff * ratio):
        return False
    cdt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}[dtype]
    return PoolBackward(cdt, ratio, coff, d, int(arch[3:-1]) // 10).has_large_variant


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--dims", default="64,128,512")
    ap.add_argument("--ratios", default="1-8")
    ap.add_argument("--coffs", default="1,2")
    ap.add_argument("--dirs", default="fwd,bwd,bwd_large")
    ap.add_argument("--archs", default="sm_90a,sm_100a")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--config", default="", help="CSA_CONFIG overrides for every compile")
    a = ap.parse_args()
    from csa_compressor.kernels import hardware

    jobs = []
    for arch in a.archs.split(","):
        for dtype in a.dtypes.split(","):
            for d in _ints(a.dims):
                for ratio in _ints(a.ratios):
                    for coff in _ints(a.coffs):
                        for direction in a.dirs.split(","):
                            if direction == "bwd_large" and not has_large_variant(dtype, ratio, coff, d, arch):
                                continue
                            jobs.append((arch, (direction, dtype, ratio, coff, d)))
    bad = []
    with ThreadPoolExecutor(a.jobs) as pool:
        for (arch, cfg), info in zip(jobs, pool.map(lambda j: probe(j[0], j[1], a.config), jobs)):
            keep = {k: info.get(k) for k in ("error", "regs", "spills", "stack", "local", "min_ctas",
                                             "target_ctas", "grid_ctas", "threads")}
            print(json.dumps({"arch": arch, "cfg": cfg, **keep}), flush=True)
            if info.get("error") or any(info["spills"]) or any(info["stack"]) or info["local"]:
                bad.append((arch, cfg, keep))
            elif info.get("grid_ctas") and info["grid_ctas"] > hardware.ctas_fitting_registers(
                    max(info["regs"]), info["threads"]):
                bad.append((arch, cfg, {**keep, "grid": "more CTAs than the registers hold"}))
    print(f"\n{len(bad)} of {len(jobs)} specialisations spill, use a stack or local memory, "
          "size a grid past their registers, or fail:")
    for arch, cfg, keep in bad:
        print(arch, *cfg, keep)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
