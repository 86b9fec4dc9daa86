"""Developer probe (GPU): which host op of a streaming call waits for the GPU.

Each call (prefill into empty slots on the "fused" and "ring" paths, 8 prompts of 4096
tokens, head_dim 512, ratio 4) is enqueued behind a 5 ms spin kernel under torch.profiler:
an op that waits for the GPU lasts until the spin ends, so the CPU ops longer than 1 ms
name it (none: the call enqueues without waiting). torch.cuda's sync debug mode is on
("warn") for the same call.

    python tools/streaming_sync_probe.py
"""

import os as _os, sys as _sys  # noqa: E401
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))
from _tool import start  # noqa: E402

start(__doc__, gpu=True)

import torch

from csa_compressor import streaming


def main():
    dev = torch.device("cuda")
    B, S, D, r, coff = 8, 4096, 512, 4, 2
    W = coff * D
    kv = torch.randn(B * S, W, device=dev).bfloat16()
    sc = torch.randn_like(kv)
    ape = torch.randn(r, W, device=dev)
    st = streaming.StreamState(B, D, ratio=r, coff=coff, dtype=torch.bfloat16, device=dev)
    cu, slots = [i * S for i in range(B + 1)], list(range(B))
    for pooling in ("fused", "ring"):
        call = lambda: streaming.prefill(st, kv, sc, ape, cu, slots, pooling=pooling)  # noqa: E731
        for _ in range(3):
            st.reset()
            call()
        st.reset()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            torch.cuda._sleep(10_000_000)  # some 5 ms at the H100/H200 clocks
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        long = [e for e in prof.events() if e.time_range.elapsed_us() > 1000]
        print(f"--- prefill {pooling}: CPU ops over 1 ms behind the spin ---")
        for e in sorted(long, key=lambda e: e.time_range.start):
            print(f"{e.time_range.elapsed_us():9.1f} µs  {e.name}")
        if not long:
            print("none")


main()
