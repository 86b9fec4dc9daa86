"""Command line: `csa-compressor {info,bench,check,report}` (or `python -m csa_compressor`).

Exit codes: 0 done (``check``: every clause held), 1 ``check`` found a failing clause, 2
bad arguments or nothing could be run here (``bench`` / ``check`` without a CUDA GPU).
Arguments are checked before torch is imported, so ``--help`` and mistakes answer at once.
"""

from __future__ import annotations

import argparse
import sys

NOTHING_RUN = 2
DTYPE_NAMES = ("bf16", "fp16", "fp32")


def _no_gpu(what: str) -> int:
    print(f"{what}: no CUDA GPU visible, nothing was run. The fused kernels need an NVIDIA GPU "
          "with compute capability 9.0 or newer (H100/H200, B200/GB200); "
          "`csa-compressor info` says what this machine has.", file=sys.stderr)
    return NOTHING_RUN


def cmd_info(args) -> int:
    import torch

    from ..testing import make_inputs
    from ..dispatch import fused_unavailable_reason
    from ..runtime import dsl_import_error
    from ..shapes import parse_shape

    print(f"csa_compressor {__import__('csa_compressor').__version__}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA runtime {torch.version.cuda}")
    err = dsl_import_error()
    if err is None:
        import cutlass

        print(f"CuTe DSL {cutlass.__version__}")
    else:
        print(err)
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"cuda:{i}: {p.name}, compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
        dev = "cuda"
    else:
        print("no CUDA GPU visible")
        dev = "cpu"
    shape = parse_shape("1x8192:512:4:2")
    kv, score, ape, cu, cuc, N, _ = make_inputs(shape, torch.bfloat16, torch.device(dev))
    reason = fused_unavailable_reason(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    print(f"sample {shape.name} bf16 on {dev}: "
          + ("fused kernels would run" if reason is None else f"eager fallback ({reason})"))
    return 0


def cmd_bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        return _no_gpu("bench")
    from . import bench

    if args.module:
        from . import module_bench

        rows = module_bench.run(progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(module_bench.header(bench.environment(), rows))
        print(module_bench.table(rows))
        return 0
    if args.streaming:
        from . import streaming_bench

        rows, extra = streaming_bench.run(progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(streaming_bench.header(bench.environment()))
        print(streaming_bench.table(rows, extra))
        return 0
    if args.sbhd:
        from . import sbhd_bench

        rows = sbhd_bench.run(progress=lambda m: print(m, file=sys.stderr, flush=True))
        print(sbhd_bench.header(bench.environment()))
        print(sbhd_bench.table(rows))
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    result = bench.run(args.shape_list, dtype, args.impl_list, compile_all=args.compile_all,
                       progress=lambda m: print(m, file=sys.stderr, flush=True),
                       same_inputs=args.same_inputs)
    print(bench.header(result))
    print(bench.table(result))
    if args.out:
        for f in bench.write(result, args.out):
            print(f"wrote {f}")
    return 0


def cmd_check(args) -> int:
    import torch

    if not torch.cuda.is_available():
        return _no_gpu("check")
    from . import check

    return check.run(dtypes=args.dtype_list)


def cmd_report(args) -> int:
    """Re-render results.md and the plots from a results.json (e.g. one made on a GPU
    machine without matplotlib); the measurements are not touched."""
    import json

    from . import bench

    try:
        with open(args.results) as f:
            result = json.load(f)
        bench.header(result), bench.table(result)  # a file bench did not write fails here
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"csa-compressor report: cannot read {args.results} as a bench results.json "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return NOTHING_RUN
    for path in bench.write(result, args.out, with_json=False):
        print(f"wrote {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="csa-compressor", description=__doc__.split("\n")[0],
                                 epilog="exit codes: 0 done, 1 check failed, 2 bad arguments or nothing run")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="environment, and which path would run and why",
                   description="Versions of Python, torch and the CuTe DSL, the visible GPUs, and "
                               "whether the fused kernels would run on a sample problem (and why not).")
    b = sub.add_parser("bench", help="eager vs torch.compile vs fused, side by side (CUDA GPU)",
                       description="Time the pooling forward and forward+backward per shape: eager "
                                   "torch, torch.compile and the fused kernels, 20 calls per CUDA "
                                   "graph with inputs rotated past the L2, against the copy floor.")
    b.add_argument("--shapes", default="default",
                   help='"default", "production", "all", or e.g. "3x8192:512:4:2,1023+2048+509:128:4:2" '
                        "(pack:head_dim:ratio:coff)")
    b.add_argument("--dtype", default="bf16", choices=DTYPE_NAMES)
    b.add_argument("--impls", default="eager,compile,fused", help="from eager, compile, fused, fused_eager, fused_plan")
    b.add_argument("--compile-all", action="store_true", help="torch.compile every shape (slow)")
    b.add_argument("--same-inputs", action="store_true",
                   help="all 20 calls of a graph on the same inputs (L2-warm where a pack fits) "
                        "instead of rotating over inputs of twice the L2")
    b.add_argument("--out", help="write results.json, results.md and PNG plots here")
    b.add_argument("--module", action="store_true",
                   help="the whole Compressor module's training step instead (one projection "
                        "against two, and the projection GEMMs alone)")
    b.add_argument("--sbhd", action="store_true",
                   help="SBHD inputs instead: the kernels reading (S, B, ...) in place against a "
                        "transposed copy into THD, and the eager region")
    b.add_argument("--streaming", action="store_true",
                   help="csa_compressor.streaming instead: prefill against the training forward, "
                        "a captured decode step against its floor")
    c = sub.add_parser("check", help="the numerics gate (CUDA GPU): exit 1 on a failing clause",
                       description="The numerics contract on this GPU: the fused op against the "
                                   "references (bitwise where the contract says so), the epilogue "
                                   "and the pooling with the epilogue against their compositions.")
    c.add_argument("--dtypes", default=",".join(DTYPE_NAMES), help="from bf16, fp16, fp32")
    p = sub.add_parser("report", help="results.md and PNG plots from a results.json",
                       description="Re-render results.md (and the plots, with the [bench] extra) "
                                   "from a results.json that bench --out wrote; measures nothing.")
    p.add_argument("results")
    p.add_argument("--out", default=".")
    return ap


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    from ..shapes import parse_impls, shapes_from_arg

    try:
        if args.cmd == "bench":
            args.shape_list = shapes_from_arg(args.shapes)
            args.impl_list = parse_impls(args.impls)
        if args.cmd == "check":
            args.dtype_list = tuple(n.strip() for n in args.dtypes.split(",") if n.strip())
            if not args.dtype_list or set(args.dtype_list) - set(DTYPE_NAMES):
                raise ValueError(f"--dtypes: expected names from {', '.join(DTYPE_NAMES)}, got {args.dtypes!r}")
    except ValueError as exc:
        ap.error(str(exc))  # exits 2
    return {"info": cmd_info, "bench": cmd_bench, "check": cmd_check, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
