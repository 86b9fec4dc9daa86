"""A toy generation loop over csa_compressor.streaming: prefill a batch of prompts, decode
64 tokens each, and check every emitted row against the training forward of the full
sequences (bit for bit). Runs on a GPU (the fused kernels) or the CPU (the reference).

    python examples/streaming_generation.py
"""

import torch

from csa_compressor import Epilogue, compress_thd_fused, compressed_cu_seqlens, reference, streaming
from csa_compressor.epilogue_op import apply_epilogue

dev = "cuda" if torch.cuda.is_available() else "cpu"
fused = dev == "cuda"
ratio, coff, d, B, steps = 4, 2, 128, 4, 64
ep = Epilogue(rope_dim=64)
torch.manual_seed(0)
prompts = [37, 5, 128, 64]
lens = [p + steps for p in prompts]
start = [0] + torch.tensor(lens).cumsum(0).tolist()
kv = torch.randn(sum(lens), coff * d).bfloat16().to(dev)  # stand-ins for the projections
score = torch.randn(sum(lens), coff * d).bfloat16().to(dev)
ape = torch.randn(ratio, coff * d, device=dev)
norm_weight = torch.rand(d, device=dev) + 0.5
kw = dict(epilogue=ep, norm_weight=norm_weight, pooling="fused" if fused else "reference")

state = streaming.StreamState(B, d, ratio=ratio, coff=coff, device=dev)
emitted = [dict() for _ in range(B)]  # slot -> {block index: row}

# prefill: the prompts as one ragged THD batch
pick = torch.cat([torch.arange(start[b], start[b] + prompts[b]) for b in range(B)]).to(dev)
cu = [0] + torch.tensor(prompts).cumsum(0).tolist()
out = streaming.prefill(state, kv[pick], score[pick], ape, cu, list(range(B)), **kw)
for row, slot, pos in zip(out.rows, out.slots.tolist(), out.positions.tolist()):
    emitted[slot][pos // ratio] = row

# decode: one token a slot a step (a real model would project its newest hidden state)
for k in range(steps):
    idx = torch.tensor([start[b] + prompts[b] + k for b in range(B)], device=dev)
    step = streaming.decode(state, kv[idx].unsqueeze(1), score[idx].unsqueeze(1), ape, **kw)
    for b in range(B):
        if step.emitted[b, 0]:
            emitted[b][int(step.positions[b, 0]) // ratio] = step.rows[b, 0]

# the training forward over the full sequences
cu_all = torch.tensor(start, dtype=torch.int32, device=dev)
cu_comp = compressed_cu_seqlens(cu_all, ratio)
n = sum(x // ratio for x in lens)
if fused:
    train = compress_thd_fused(kv, score, ape, cu_all, cu_comp, n, ratio=ratio, coff=coff,
                               epilogue=ep, norm_weight=norm_weight)
else:
    pos = torch.cat([torch.arange(x // ratio) * ratio for x in lens])
    train = apply_epilogue(reference.compress_thd(kv, score, ape, cu_all, cu_comp, n, ratio=ratio,
                                                  coff=coff), norm_weight, pos, ep)
offs = cu_comp.tolist()
for b in range(B):
    rows = train[offs[b]:offs[b + 1]]
    assert sorted(emitted[b]) == list(range(rows.shape[0]))
    assert all(torch.equal(emitted[b][i], rows[i]) for i in range(rows.shape[0]))
print(f"{sum(len(e) for e in emitted)} streamed rows on {dev}, every one bitwise the training forward's")
