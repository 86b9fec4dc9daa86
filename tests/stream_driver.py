"""A generation loop over csa_compressor.streaming for the tests: sequences stream through
slots (prefill in random chunks, several slots a call; decode one or next_n tokens a
step with drafts partly rejected and taken back; slots reused as sequences finish), and
every kept row is compared bit for bit with the training op over the whole sequences."""

from __future__ import annotations

import random

import torch

from csa_compressor import reference, streaming
from csa_compressor.streaming import ring
from csa_compressor.streaming.rows import settings
from csa_compressor.epilogue_op import apply_epilogue
from csa_compressor.layout import compressed_cu_seqlens
from csa_compressor.ops import compress_thd_fused


def takes_the_ring_kernel(st, B=2, n=1, numerics="fp32"):
    """Whether decode(pooling="ring") on ``st`` takes its one-launch kernel."""
    kv = torch.zeros(B, n, st.width, dtype=st.dtype, device=st.device)
    ape = torch.zeros(st.ratio, st.width, device=st.device)
    s = settings(st, kv.view(B * n, -1), kv.view(B * n, -1), ape, numerics, None, None, None,
                 "ring")
    return ring.launcher(st, kv, kv, ape, s) is not None


def random_lens(ratio, k, seed, longest):
    """``k`` sequence lengths in ``[ratio, longest)``, seeded."""
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(ratio, longest, (k,), generator=g)]


def training_rows(kv, score, ape, lens, ratio, coff, numerics, ep, w, fused):
    """Per sequence, its rows as the training op computes them over one pack of all."""
    dev = kv.device
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    cuc = compressed_cu_seqlens(cu, ratio)
    n = sum(x // ratio for x in lens)
    if ep is not None:  # the norm's order differs below 16 rows (softmax_order.ROWSUM_MIN_ROWS)
        n = max(n, 16)
    if fused:
        out = compress_thd_fused(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                 numerics=numerics, epilogue=ep, norm_weight=w)
    else:
        out = reference.compress_thd(kv, score, ape, cu, cuc, n, ratio=ratio, coff=coff,
                                     mode=reference.MODE_OF_NUMERICS[numerics])
        if ep is not None:
            pos = torch.cat([torch.arange(x // ratio) * ratio for x in lens]).to(dev)
            pos = torch.cat([pos, pos.new_zeros(n - pos.shape[0])])
            out = apply_epilogue(out, w, pos, ep)
    offs = cuc.tolist()
    return [out[offs[s]:offs[s + 1]] for s in range(len(lens))]


class Stream:
    """Drives ``state`` over ``lens`` sequences of random tokens."""

    def __init__(self, state, lens, *, seed=0, numerics="fp32", ep=None, pooling="reference",
                 max_n=1, slot_tensor_on_device=False):
        self.st, self.lens, self.r = state, lens, state.ratio
        self.rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        W, dt, dev = state.width, state.dtype, state.device
        T = sum(lens)
        self.kv = torch.randn(T, W, generator=g).to(dt).to(dev)
        self.score = (2 * torch.randn(T, W, generator=g)).to(dt).to(dev)
        self.ape = torch.randn(state.ratio, W, generator=g).to(dev)
        self.w = (torch.rand(state.head_dim, generator=g) + 0.5).to(dev) if ep else None
        self.kw = dict(numerics=numerics, epilogue=ep, norm_weight=self.w, pooling=pooling)
        self.start = [0] + torch.tensor(lens).cumsum(0).tolist()
        self.max_n, self.dev_slots = max_n, slot_tensor_on_device
        self.got = [dict() for _ in lens]
        self.seen = [0] * len(lens)

    def tokens(self, s, a, b):
        o = self.start[s]
        return self.kv[o + a:o + b], self.score[o + a:o + b]

    def keep(self, seq, block, row, upto):
        if (block + 1) * self.r <= upto:
            self.got[seq][block] = row.clone()

    def prefill(self, pairs):
        """pairs: [(slot, seq, n)]: one call with a chunk for each."""
        kvs, scs, cu, slots = [], [], [0], []
        for slot, seq, n in pairs:
            k, s = self.tokens(seq, self.seen[seq], self.seen[seq] + n)
            kvs.append(k), scs.append(s), cu.append(cu[-1] + n), slots.append(slot)
        res = streaming.prefill(self.st, torch.cat(kvs), torch.cat(scs), self.ape, cu, slots,
                                **self.kw)
        owner = {slot: seq for slot, seq, _ in pairs}
        for slot, seq, n in pairs:
            self.seen[seq] += n
        for row, slot, pos in zip(res.rows, res.slots.tolist(), res.positions.tolist()):
            seq = owner[slot]
            self.keep(seq, pos // self.r, row, self.seen[seq])

    def decode(self, pairs, n):
        """pairs: [(slot, seq)]: one step of ``n`` tokens each, drafts after a random
        accepted prefix replaced by noise and taken back."""
        dev, W = self.st.device, self.st.width
        kv = torch.empty(len(pairs), n, W, dtype=self.st.dtype, device=dev)
        sc = torch.empty_like(kv)
        accept = []
        for b, (slot, seq) in enumerate(pairs):
            left = self.lens[seq] - self.seen[seq]
            a = min(left, n if n == 1 or self.rng.random() < 0.3 else self.rng.randint(0, n))
            k, s = self.tokens(seq, self.seen[seq], self.seen[seq] + a)
            kv[b, :a], sc[b, :a] = k, s
            kv[b, a:] = torch.randn(n - a, W).to(kv.dtype).to(dev) * 3
            sc[b, a:] = torch.randn(n - a, W).to(kv.dtype).to(dev) * 3
            accept.append(a)
        slots = torch.tensor([p[0] for p in pairs])
        if self.dev_slots:
            slots = slots.to(dev)
        step = streaming.decode(self.st, kv, sc, self.ape, slots, **self.kw)
        for b, (slot, seq) in enumerate(pairs):
            upto = self.seen[seq] + accept[b]
            for j in range(step.rows.shape[1]):
                if step.emitted[b, j]:
                    self.keep(seq, int(step.positions[b, j]) // self.r, step.rows[b, j], upto)
            self.seen[seq] = upto
        k = torch.tensor([n - a for a in accept])
        if any(k.tolist()):
            streaming.take_back(self.st, k.to(dev) if self.dev_slots else k, slots)

    def run(self, prefill_share=0.5):
        """Every sequence through: slots taken by sequences in turn, prefill of a share of
        each, then decode steps over the active slots until all are done."""
        waiting = list(range(len(self.lens)))
        active = {}  # slot -> seq
        free = list(range(self.st.num_slots))
        while waiting or active:
            while free and waiting:
                slot, seq = free.pop(0), waiting.pop(0)
                self.st.reset([slot])
                active[slot] = seq
                target = int(self.lens[seq] * prefill_share)
                while self.seen[seq] < target:
                    n = self.rng.randint(1, max(1, target - self.seen[seq]))
                    others = [(s, q, min(self.rng.randint(0, 9), self.lens[q] - self.seen[q]))
                              for s, q in active.items() if q != seq and self.rng.random() < 0.3]
                    self.prefill([(slot, seq, n)] + others)
            pairs = list(active.items())
            self.decode(pairs, self.rng.randint(1, self.max_n))
            for slot, seq in pairs:
                if self.seen[seq] >= self.lens[seq]:
                    del active[slot]
                    free.append(slot)

    def check(self, fused=False):
        st = self.st  # the host's counts, where it keeps them, are the device's
        assert st.host_counts is None or st.host_counts == st.count[: st.num_slots].tolist()
        want = training_rows(self.kv, self.score, self.ape, self.lens, self.r, self.st.coff,
                             self.kw["numerics"], self.kw["epilogue"], self.w, fused)
        for seq, rows in enumerate(want):
            got = self.got[seq]
            assert sorted(got) == list(range(rows.shape[0])), (seq, sorted(got), rows.shape[0])
            for i in range(rows.shape[0]):
                assert torch.equal(got[i], rows[i]), (seq, i, (got[i] - rows[i]).abs().max())


def captured_replay(ratio, coff, dtype, ep, pooling, B=8, d=512, steps=64):
    """B prompts prefilled, then ``steps`` decode steps of one token: one eager (it
    compiles), the rest replays of one captured step with new tokens copied into its
    buffers. Every row kept is compared bit for bit with the fused training forward;
    returns the state."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    prompts = [int(x) for x in torch.randint(1, 3 * ratio, (B,))]
    lens = [p + steps for p in prompts]
    W = coff * d
    kv = torch.randn(sum(lens), W, device=dev, generator=g).to(dtype)
    sc = torch.randn(sum(lens), W, device=dev, generator=g).to(dtype)
    ape = torch.randn(ratio, W, device=dev, generator=g)
    w = torch.rand(d, device=dev, generator=g) + 0.5 if ep is not None else None
    start = [0] + torch.tensor(lens).cumsum(0).tolist()
    st = streaming.StreamState(B, d, ratio=ratio, coff=coff, dtype=dtype, device=dev)
    kw = dict(epilogue=ep, norm_weight=w, pooling=pooling)
    got = [dict() for _ in range(B)]
    cu = [0] + torch.tensor(prompts).cumsum(0).tolist()
    res = streaming.prefill(st, torch.cat([kv[start[b]:start[b] + prompts[b]] for b in range(B)]),
                            torch.cat([sc[start[b]:start[b] + prompts[b]] for b in range(B)]),
                            ape, cu, list(range(B)), **kw)
    for row, s, p in zip(res.rows, res.slots.tolist(), res.positions.tolist()):
        got[s][p // ratio] = row.clone()
    kv_buf = torch.empty(B, 1, W, device=dev, dtype=dtype)
    sc_buf = torch.empty_like(kv_buf)
    slots = torch.arange(B, device=dev)

    def feed(k):
        idx = torch.tensor([start[b] + prompts[b] + k for b in range(B)], device=dev)
        kv_buf.copy_(kv[idx].view(B, 1, W))
        sc_buf.copy_(sc[idx].view(B, 1, W))

    def keep(step):
        for b in range(B):
            if bool(step.emitted[b, 0]):
                got[b][int(step.positions[b, 0]) // ratio] = step.rows[b, 0].clone()

    feed(0)
    keep(streaming.decode(st, kv_buf, sc_buf, ape, slots, **kw))  # compiles, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = streaming.decode(st, kv_buf, sc_buf, ape, slots, **kw)
    for k in range(1, steps):
        feed(k)
        graph.replay()
        keep(out)
    want = training_rows(kv, sc, ape, lens, ratio, coff, "fp32", ep, w, fused=True)
    for b in range(B):
        assert sorted(got[b]) == list(range(want[b].shape[0]))
        for i in range(want[b].shape[0]):
            assert torch.equal(got[b][i], want[b][i]), (b, i)
    assert st.count[:B].tolist() == lens
    return st
