"""Developer probe: where Megatron-LM's Compressor step spends host time, eager against
csa_compressor.megatron installed, on one config and path of tools/megatron_bench.py.
For each: host µs a step (back-to-back steps, one sync after each batch), whether a step
syncs with the device (torch.cuda.set_sync_debug_mode), and a cProfile of the steps.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python tools/megatron_host_probe.py \
        [d512r128 | d512r4 | d128r4rot] [thd | grouped | sbhd] [steps]
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
import _tool  # noqa: E402
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import contextlib
import sys
import tempfile
import warnings

import torch

from megatron_bench import HIDDEN, ROPE_DIM, _csa

CONFIGS = {"d512r128": (512, 128, False), "d512r4": (512, 4, False), "d128r4rot": (128, 4, True)}


def build(name, path, lens=(8192, 8192, 8192)):
    csa = _csa()
    from megatron.core.packed_seq_params import PackedSeqParams

    from csa_compressor.testing import megatron_compressor, megatron_one_process

    megatron_one_process(tempfile.mkdtemp())
    d, ratio, rotate = CONFIGS[name]
    dev = torch.device("cuda")
    comp = megatron_compressor(csa, HIDDEN, d, ratio, ROPE_DIM, rotate=rotate,
                               dtype=torch.bfloat16).to(dev)
    T, L = sum(lens), max(lens)
    if path == "thd":
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                          device=dev)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=L, max_seqlen_kv=L)
        x = torch.randn(T, 1, HIDDEN, device=dev).to(torch.bfloat16).requires_grad_(True)
        call = lambda: comp(x, psp)[0]  # noqa: E731
    elif path == "grouped":
        ids = torch.cat([torch.arange(n // ratio, dtype=torch.int32) for n in lens]).to(dev)
        x = torch.randn(ids.numel() * ratio, 1, HIDDEN, device=dev).to(torch.bfloat16)
        x.requires_grad_(True)
        cug = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=dev)
        call = lambda: comp._forward_thd(x, cug, max_seqlen_q=L, compressed_group_ids=ids)[0]  # noqa: E731
    else:
        x = torch.randn(L, len(lens), HIDDEN, device=dev).to(torch.bfloat16).requires_grad_(True)

        def call():
            out = comp(x)
            return out[0] if isinstance(out, tuple) else out
    grad = []

    def step():
        x.grad = None
        comp.zero_grad(set_to_none=True)
        out = call()
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])
    return step


def main(name="d512r128", path="sbhd", steps=20):
    from csa_compressor import megatron

    step = build(name, path)
    for label, ctx in (("eager", None), ("installed", megatron.installed)):
        with ctx() if ctx else contextlib.nullcontext():
            us = _tool.host_us(step, steps, torch.cuda.synchronize)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            torch.cuda.set_sync_debug_mode("default")
            syncs = [str(w.message).splitlines()[0][:120] for w in caught
                     if "synchroniz" in str(w.message)]
            print(f"\n===== {name} {path} {label}: {us:.0f} µs host a step; "
                  f"{len(syncs)} syncs in a step {syncs[:3]} =====")
            _tool.print_cprofile(step, steps, torch.cuda.synchronize, (35, 0))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(*(a[:2]), *(int(v) for v in a[2:3]))
