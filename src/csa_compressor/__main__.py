"""Command line: `python -m csa_compressor {info,bench,check,report}`."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def cmd_info(args) -> int:
    from .dispatch import fused_unavailable_reason
    from .kernels.compile import dsl_import_error

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
    from .bench import make_inputs, parse_shape

    shape = parse_shape("1x8192:512:4:2")
    kv, score, ape, cu, cuc, N, _ = make_inputs(shape, torch.bfloat16, torch.device(dev))
    reason = fused_unavailable_reason(kv, score, ape, cu, cuc, N, ratio=4, coff=2)
    print(f"sample {shape.name} bf16 on {dev}: "
          + ("fused kernels would run" if reason is None else f"eager fallback ({reason})"))
    return 0


def cmd_bench(args) -> int:
    from . import bench

    if not torch.cuda.is_available():
        return bench.no_gpu_demo()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes = bench.shapes_from_arg(args.shapes)
    impls = tuple(args.impls.split(","))
    result = bench.run(shapes, dtype, impls, compile_all=args.compile_all,
                       progress=lambda m: print(m, file=sys.stderr, flush=True),
                       same_inputs=args.same_inputs)
    print(bench.header(result))
    print(bench.table(result))
    if args.out:
        for f in bench.write(result, args.out):
            print(f"wrote {f}")
    return 0


def cmd_check(args) -> int:
    from . import check

    if not torch.cuda.is_available():
        print("No CUDA GPU: the numerics gate compares the fused kernels with the references and "
              "needs an NVIDIA GPU with compute capability 9.0 or newer.")
        return 0
    return check.run(dtypes=tuple(args.dtypes.split(",")))


def cmd_report(args) -> int:
    """Re-render results.md and the plots from a results.json (e.g. one made on a GPU
    machine without matplotlib); the measurements are not touched."""
    from . import bench

    with open(args.results) as f:
        result = json.load(f)
    for path in bench.write(result, args.out, with_json=False):
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m csa_compressor")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="environment and which path would run")
    b = sub.add_parser("bench", help="eager vs torch.compile vs fused, SPEC §8 method")
    b.add_argument("--shapes", default="default",
                   help='"default", "production", "all", or e.g. "3x8192:512:4:2,1023+2048+509:128:4:2"')
    b.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    b.add_argument("--impls", default="eager,compile,fused")
    b.add_argument("--compile-all", action="store_true", help="torch.compile every shape (slow)")
    b.add_argument("--same-inputs", action="store_true",
                   help="all 20 calls of a graph on the same inputs (L2-warm where a pack fits) "
                        "instead of rotating over inputs of twice the L2")
    b.add_argument("--out", help="write results.json, results.md and PNG plots here")
    c = sub.add_parser("check", help="SPEC §5 numerics gate; non-zero exit on failure")
    c.add_argument("--dtypes", default="bf16,fp16,fp32")
    p = sub.add_parser("report", help="results.md and PNG plots from a results.json")
    p.add_argument("results")
    p.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    return {"info": cmd_info, "bench": cmd_bench, "check": cmd_check, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
