"""Which order torch's CUDA reduce kernel adds a contiguous fp32 ``(N, d)`` tensor's columns
in (``prod.sum(0)``: the norm weight's gradient in the epilogue's backward), found by
matching candidates bit for bit, before a kernel may claim torch's bits for it.

The candidates follow this reading of ``setReduceConfig`` (ATen/native/cuda/Reduce.cuh) for
a reduction over the slow dimension, outputs contiguous: ``vec`` outputs a thread (4, 2
or 1 as d divides), a block of ``bx`` x ``by`` threads (``bx`` over output vectors, ``by``
over rows where the rows are split across warps; at most 512 / ``vec`` threads), ``ctas`` blocks along the rows with a
global reduction by the last block to finish. Thread ``(c, y)`` takes rows
``y + by*c + k*by*ctas``, load ``k`` into accumulator ``k % acc``, the accumulators met in
order; the block's threads meet in a tree over ``y``; the last block's thread ``y`` adds the
partials of blocks ``y, y + by, ...`` from zero, then the same tree. Printed per (N, d): the
config and the candidates (accumulators 4 or 1, the tree halving ``down`` 8, 4, 2, 1 or
doubling ``up``) whose sums equal torch's bit for bit.

    python tools/torch_colsum_order_probe.py [N,...] [d,...]
"""
import sys

import torch

MAX_THREADS = 512  # Reduce.cuh's limit for 4-byte accumulators, shared by a thread's outputs


def _last_pow2(v):
    return 1 << (v.bit_length() - 1)


def _div_up(a, b):
    return -(-a // b)


def config(N, d, sms, threads_per_sm):
    vec = 4 if d % 4 == 0 else 2 if d % 2 == 0 else 1
    dim0, dim1 = d // vec, N
    limit = MAX_THREADS // vec  # set_block_dimension: the thread limit over the output vector
    p0 = _last_pow2(dim0) if dim0 < limit else limit
    p1 = _last_pow2(dim1) if dim1 < limit else limit
    bx = min(p0, 32)
    by = min(p1, limit // bx)
    bx = min(p0, limit // by)
    step_out, step_in = bx, 1
    split = N >= min(by * 16, 256)
    if split:
        step_in = by
    else:
        step_out *= by
    ctas = 1
    grid_x = _div_up(dim0, step_out)
    target = sms * (threads_per_sm // (bx * by))
    vpt = _div_up(N, step_in)
    if split and vpt >= 256 and grid_x <= target:
        ctas = max(min(_div_up(target, grid_x), _div_up(vpt, 16)), _div_up(vpt, 256))
    return dict(vec=vec, bx=bx, by=by, split=split, ctas=ctas)


def _tree(vals, direction):
    """vals: list over y of column vectors; threadIdx.y < off takes y + off."""
    v = list(vals)
    n = len(v)
    if direction == "down":
        off = n // 2
        while off > 0:
            for y in range(off):
                if y + off < n:
                    v[y] = v[y] + v[y + off]
            off //= 2
    else:
        off = 1
        while off < n:
            for y in range(0, n, 2 * off):
                if y + off < n:
                    v[y] = v[y] + v[y + off]
            off *= 2
    return v[0]


def _thread(x, rows, acc_n):
    acc = [torch.zeros(x.shape[1], dtype=x.dtype, device=x.device) for _ in range(acc_n)]
    for k, r in enumerate(rows):
        acc[k % acc_n] = acc[k % acc_n] + x[r]
    out = acc[0]
    for a in acc[1:]:
        out = out + a
    return out


def emulate(x, cfg, acc_n, direction):
    N = x.shape[0]
    by, ctas = cfg["by"], cfg["ctas"]
    if not cfg["split"]:  # one thread a column: every row, in order
        return _thread(x, range(N), acc_n)
    step = by * ctas
    parts = []
    for c in range(ctas):
        vals = [_thread(x, range(y + by * c, N, step), acc_n) for y in range(by)]
        parts.append(_tree(vals, direction))
    if ctas == 1:
        return parts[0]
    last = []
    for y in range(by):
        v = torch.zeros_like(parts[0])
        for c in range(y, ctas, by):
            v = v + parts[c]
        last.append(v)
    return _tree(last, direction)


def main(argv):
    Ns = ([int(v) for v in argv[0].split(",")] if argv
          else [16, 63, 64, 100, 192, 257, 1000, 1024, 6144, 6150, 24576])
    ds = [int(v) for v in argv[1].split(",")] if len(argv) > 1 else [64, 96, 128, 512]
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms, tps = props.multi_processor_count, props.max_threads_per_multi_processor
    g = torch.Generator(dev).manual_seed(0)
    print(f"torch {torch.__version__}, {props.name}: {sms} SMs, {tps} threads an SM")
    for d in ds:
        for N in Ns:
            x = torch.randn(N, d, device=dev, generator=g) * torch.rand(N, 1, device=dev, generator=g) * 10
            want = x.sum(0)
            cfg = config(N, d, sms, tps)
            hits = [f"acc{a}/{t}" for a in (4, 1) for t in ("down", "up")
                    if torch.equal(emulate(x, cfg, a, t), want)]
            print(f"N={N} d={d} {cfg}: {' '.join(hits) or 'no candidate'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
