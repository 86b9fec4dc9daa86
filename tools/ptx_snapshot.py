"""The PTX of a grid of kernel specialisations, written one file a kernel, and a comparison
of two such snapshots: the safety net of a refactor (runs on a CPU machine, no GPU).

    python tools/ptx_snapshot.py write DIR [--archs sm_90a,sm_100a] [--jobs 2] [--epilogue]
    python tools/ptx_snapshot.py compare DIR_BEFORE DIR_AFTER

Kernel symbols are normalised before comparing (they spell the defining class's module
path), so moving a kernel class between modules is not a difference; everything else is.
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=False, own_help=True)

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (dtype, ratio, coff, head_dim): the production configurations and their neighbours,
# odd head_dims, each kernel family, and windows torch's softmax splits into lanes.
GRID = ([("bfloat16", r, c, d) for r in (1, 2, 3, 4, 5, 8) for c in (1, 2) for d in (128, 512)]
        + [("bfloat16", 16, 2, 128), ("bfloat16", 128, 1, 512), ("bfloat16", 128, 1, 128),
           ("bfloat16", 128, 2, 512), ("bfloat16", 128, 1, 64), ("bfloat16", 12, 1, 65),
           ("bfloat16", 7, 2, 512), ("bfloat16", 6, 1, 128),
           ("float16", 4, 2, 64), ("float16", 1, 1, 65), ("float32", 8, 2, 64),
           ("float32", 4, 2, 512), ("float32", 3, 2, 65)])


# The packed layout ([kv | score] in one tensor: rows 2*coff*d apart, compress_thd_fused_packed
# and the Compressor module's path): the production configurations and an odd neighbour.
PACKED = [("bfloat16", 4, 2, 128), ("bfloat16", 4, 2, 512), ("bfloat16", 128, 1, 512),
          ("bfloat16", 4, 1, 64), ("float32", 8, 2, 64), ("float16", 3, 2, 96)]


# The kernels with the epilogue inside (kernels/pool_epilogue.py), short and long windows,
# separate and packed rows: (dtype, ratio, coff, head_dim, packed, epilogue) with the
# epilogue as "rope_dim:interleaved:rotate:weight dtype".
EPILOGUE = [("bfloat16", 4, 2, 512, False, "64:0:0:float32"), ("bfloat16", 4, 2, 128, False, "64:1:1:float32"),
            ("bfloat16", 4, 2, 512, True, "64:0:0:bfloat16"), ("bfloat16", 4, 2, 128, True, "64:0:1:bfloat16"),
            ("bfloat16", 8, 1, 64, False, "0:1:1:float32"), ("bfloat16", 128, 1, 512, False, "64:0:0:float32"),
            ("bfloat16", 128, 2, 128, False, "64:1:1:float32")]


def epilogue_key(ep: str):
    """The EpilogueKey of ``"rope_dim:interleaved:rotate:weight dtype"`` (eps 1e-6), None for ""."""
    import torch

    from csa_compressor.kernels import plan

    if not ep:
        return None
    rope, inter, rot, w = ep.split(":")
    return plan.EpilogueKey(int(rope), inter == "1", rot == "1", 1e-6, getattr(torch, w))


def build(direction, dtype, ratio, coff, d, arch, row_stride=0, ep="") -> bool:
    """Compile one kernel (its PTX lands in CUTE_DSL_DUMP_DIR); False where the
    specialisation has no such kernel (a large-pack backward, a wide dape layout)."""
    from csa_compressor.kernels import compile as cc, plan

    spec = plan.spec(direction, dtype, ratio, coff, d, row_stride=row_stride,
                     epilogue=epilogue_key(ep))
    return cc.build(spec) is not None


def _worker(arch, out, cases):
    """Runs in a subprocess per architecture: the DSL reads CUTE_DSL_ARCH at import."""
    env = dict(os.environ, CUTE_DSL_ARCH=arch, CUTE_DSL_KEEP="ptx",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("CSA_COMPRESSOR_CACHE_DIR", None)  # a cache hit would compile, and dump, nothing
    code = f"""
import os, sys, tempfile, torch
sys.path.insert(0, {HERE!r})
from ptx_snapshot import build
for direction, dtype, ratio, coff, d, rs, ep in {cases!r}:
    dump = tempfile.mkdtemp()
    os.environ["CUTE_DSL_DUMP_DIR"] = dump
    if not build(direction, getattr(torch, dtype), ratio, coff, d, {arch!r}, rs, ep):
        continue
    ptx = "".join(open(os.path.join(dump, f)).read() for f in sorted(os.listdir(dump)) if f.endswith(".ptx"))
    name = (f"{arch}-{{direction}}-{{dtype}}-r{{ratio}}-c{{coff}}-d{{d}}" + ("-packed" if rs else "")
            + ("-ep" + ep.replace(":", "_") if ep else "") + ".ptx")
    open(os.path.join({out!r}, name), "w").write(ptx)
    print(name, flush=True)
"""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{arch}: {res.stderr[-2000:]}")
    return res.stdout.split()


def write(out, archs, jobs, epilogue=False):
    """The PTX of GRID and PACKED's kernels, or with ``epilogue`` EPILOGUE's."""
    os.makedirs(out, exist_ok=True)
    cases = ([(direction, *cfg, 0, "") for cfg in GRID
              for direction in ("fwd", "bwd", "bwd_large", "dape", "dape_wide")]
             + [(direction, *cfg, 2 * cfg[2] * cfg[3], "") for cfg in PACKED
                for direction in ("fwd", "bwd", "bwd_large")])
    if epilogue:
        cases = [(direction, dt, r, c, d, 2 * c * d if packed else 0, ep)
                 for dt, r, c, d, packed, ep in EPILOGUE for direction in ("fwd", "bwd", "bwd_large")]
    per = max(1, jobs // len(archs))
    chunks = [(arch, cases[i::per]) for arch in archs for i in range(per)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        names = [n for ns in pool.map(lambda a: _worker(a[0], out, a[1]), chunks) for n in ns]
    print(f"{len(names)} kernels written to {out}")


def _normalised(path):
    text = open(path).read()
    return re.sub(r"kernel_cutlass_kernel_\w+", "KERNEL", text)


def compare(a, b) -> int:
    names_a, names_b = set(os.listdir(a)), set(os.listdir(b))
    bad = 0
    for name in sorted(names_a ^ names_b):
        print(f"only in {'before' if name in names_a else 'after'}: {name}")
        bad += 1
    same = 0
    for name in sorted(names_a & names_b):
        if _normalised(os.path.join(a, name)) == _normalised(os.path.join(b, name)):
            same += 1
        else:
            print(f"differs: {name}")
            bad += 1
    print(f"{same} identical, {bad} different or missing")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("out")
    w.add_argument("--archs", default="sm_90a,sm_100a")
    w.add_argument("--jobs", type=int, default=2)
    w.add_argument("--epilogue", action="store_true",
                   help="the kernels with the epilogue inside (EPILOGUE) instead")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args()
    if args.cmd == "write":
        write(args.out, args.archs.split(","), args.jobs, args.epilogue)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
