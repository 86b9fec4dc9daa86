"""The kernel-level API (kernel_api.pool_forward / pool_backward) on the CPU: the reference
of the kernels' numerics into the caller's buffers, with an fp32 ``grad_score`` taking the
gradient of the fp32 logits before its rounding, as the kernels store it."""

import torch

from csa_compressor import reference, validation
from csa_compressor.streaming.windows import min_rows


def pool_forward(kv, score, ape, cu, cuc, out, *, ratio, coff, numerics="fp32", **_):
    mode = reference.MODE_OF_NUMERICS[numerics]
    out.copy_(reference.compress_thd(kv, score, ape, cu, cuc, out.shape[0], ratio=ratio,
                                     coff=coff, mode=mode))
    return out


def pool_backward(kv, score, ape, cu, cuc, grad_out, grad_kv, grad_score, grad_ape, *, ratio,
                  coff, numerics="fp32", **_):
    mode = reference.MODE_OF_NUMERICS[numerics]
    p = validation.validate(kv, score, ape, cu, cuc, grad_out.shape[0], ratio=ratio, coff=coff)
    T, W = kv.shape
    d, N = W // coff, grad_out.shape[0]
    t0, i, real = reference.row_geometry(p.cu_seqlens, p.cu_seqlens_comp, N, ratio)
    with torch.enable_grad():  # called inside an autograd.Function's backward
        k = kv.detach().requires_grad_(True)
        v, s, a, mask = reference._windows(k, score.detach(), ape.detach(), t0, i, ratio, coff, d)
        s32 = s.float().requires_grad_(True)  # the logits' fp32 gradient, unrounded
        a32 = a.detach().requires_grad_(True)
        out = reference._pool(v, s32, a32, mask, mode, kv.dtype)
        g = torch.where(real[:, None], grad_out, torch.zeros_like(grad_out))
        dk, ds, da = torch.autograd.grad(out, (k, s32, a32), g)
    # each token's column is in at most one window slot: a scatter of the slots' values
    tok, col = _slot_targets(t0, i, ratio, coff, d, T)
    flat = torch.zeros(T * W, dtype=torch.float32)
    keep = mask[:, :, None].expand_as(ds) & real[:, None, None]
    flat[(tok * W + col)[keep]] = ds[keep]
    grad_kv.copy_(dk)
    grad_score.copy_(flat.view(T, W).to(grad_score.dtype))
    grad_ape.copy_(da.sum(0) if coff == 1 else torch.cat([da[:, :ratio, :d].sum(0), da[:, ratio:].sum(0)], 1))
    return grad_kv, grad_score, grad_ape


def _slot_targets(t0, i, ratio, coff, d, T):
    """(token, column) of each (row, slot, element) of reference._windows' windows."""
    k = torch.arange(ratio)
    own = t0[:, None] + k[None, :]
    cols = torch.arange(d)
    if coff == 1:
        return own[:, :, None].expand(-1, -1, d), cols.expand(own.shape[0], ratio, d)
    prev = t0[:, None] - ratio + k[None, :]
    tok = torch.cat([prev, own], 1)[:, :, None].expand(-1, -1, d)
    col = torch.cat([cols.expand(ratio, d), (cols + d).expand(ratio, d)], 0)
    return tok.clamp(0, max(T - 1, 0)), col.expand(tok.shape[0], -1, -1)


class DecodeStandin:
    """kernels/pool_decode.PoolDecode's contract on the CPU, with its launch's arguments
    (kernels.launch.launch_decode): per entry, malformed (slot out of range, repeated,
    already bad, past the limit) -> the spare slot, NaN rows, no ring writes, the slot
    marked bad; else the new tokens into the ring; each closed window pooled by the reference over the ring's
    tokens as one pack starting at the sequence's block; the count advanced."""

    def __init__(self, ratio, coff, numerics="fp32"):
        self.ratio, self.coff, self.numerics = ratio, coff, numerics
        self.calls = 0

    def fn(self, ring_kv, ring_sc, kv, sc, ape, slots, count, last_n, bad, out, emit, pos,
           n, H, limit):
        self.calls += 1
        r, coff = self.ratio, self.coff
        B, spare, d = slots.shape[0], count.shape[0] - 1, out.shape[1]
        R = -(-n // r)
        raw = slots.tolist()
        for b in range(B):
            inside = 0 <= raw[b] < spare
            slot = raw[b] if inside else spare
            c = int(count[slot])
            sane = 0 <= c and c + n <= 2**31 - 1
            is_bad = (not inside or raw.count(raw[b]) > 1 or bool(bad[slot]) or not sane
                      or c + n > limit)
            c32 = c if sane else 0
            for k in range(n if not is_bad else 0):
                ring_kv[slot * H + (c + k) % H] = kv[b * n + k]
                ring_sc[slot * H + (c + k) % H] = sc[b * n + k]
            for j in range(R):
                i, row = c32 // r + j, b * R + j
                emitted = i < (c32 + n) // r
                emit[row], pos[row] = int(emitted), i * r if emitted else 0
                out[row] = 0
                if emitted and not is_bad:
                    first = max(i - (coff - 1), 0)  # the pack starts at a block of the sequence
                    toks = [slot * H + t % H for t in range(first * r, (i + 1) * r)]
                    cu = torch.tensor([0, len(toks)], dtype=torch.int32)
                    rows = i - first + 1
                    got = reference.compress_thd(  # padded: torch's order of a training pack
                        ring_kv[toks], ring_sc[toks], ape, cu, torch.tensor([0, rows], dtype=torch.int32),
                        min_rows(rows, d), ratio=r, coff=coff,
                        mode=reference.MODE_OF_NUMERICS[self.numerics])
                    out[row] = got[rows - 1]
                if is_bad:
                    out[row] = float("nan")
            count[slot], last_n[slot] = c + n, n
            if is_bad:
                bad[slot] = 1
        out[B * R:] = 0  # the padding rows of a pack for the epilogue
        pos[B * R:] = 0


class PrefillTailStandin:
    """kernels/prefill_tail.PrefillTail's contract on the CPU, with its launch's arguments
    (streaming/ring.tail): per call slot ``(slot, start, n, c, row0)``, the chunk's last
    ``min(n, history)`` tokens into the ring, count ``c + n`` and last step 0, and rows
    ``row0 ..`` of slots and positions for the blocks that closed."""

    def __init__(self, ratio):
        self.ratio, self.calls = ratio, 0

    def fn(self, kv, score, ring_kv, ring_sc, meta, count, last_n, slots, pos, H):
        self.calls += 1
        r = self.ratio
        for slot, start, n, c, row0 in meta.tolist():
            keep = min(n, H)
            for t in range(c + n - keep, c + n):
                ring_kv[slot * H + t % H] = kv[start + t - c]
                ring_sc[slot * H + t % H] = score[start + t - c]
            i0 = c // r
            for j in range((c + n) // r - i0):
                slots[row0 + j], pos[row0 + j] = slot, (i0 + j) * r
            count[slot], last_n[slot] = c + n, 0


class DecodeEntriesStandin:
    """kernels/decode_entries.DecodeEntries' contract on the CPU, with its launch's
    arguments (streaming/ring.in_place): per entry its slot checked (out of range: the
    spare; repeated, bad, past ``limit``: malformed), its tokens into the ring where well
    formed, the count advanced, ``cu`` the closing window's first ring row, -1, or the NaN
    window's row ``poison`` for a malformed entry, the emitted flag and the position."""

    def __init__(self, ratio):
        self.ratio, self.calls = ratio, 0

    def fn(self, kv, score, ring_kv, ring_sc, slots, count, last_n, bad, cu, emit, pos,
           n, H, limit, poison):
        self.calls += 1
        r, raw = self.ratio, slots.tolist()
        spare = count.shape[0] - 1
        cu[-1], pos[:] = -1, 0
        for b, s in enumerate(raw):
            inside = 0 <= s < spare
            slot = s if inside else spare
            c = int(count[slot])
            is_bad = not inside or raw.count(s) > 1 or bool(bad[slot]) or c + n > limit
            if not is_bad:
                for k in range(n):
                    ring_kv[slot * H + (c + k) % H] = kv[b * n + k]
                    ring_sc[slot * H + (c + k) % H] = score[b * n + k]
            closes = (c + n) // r > c // r
            first = c // r * r
            emit[b] = int(closes)
            pos[b] = first if closes else 0
            cu[b] = poison if is_bad else slot * H + first % H if closes else -1
            count[slot], last_n[slot] = c + n, n
            if is_bad:
                bad[slot] = 1


class PrefillOffsetsStandin:
    """kernels/prefill_offsets' contract on the CPU, with its launch's arguments
    (streaming/ring.fresh_offsets): from ``values`` (the offsets padded to ``cap + 1``, the
    slots padded to ``cap``) the offsets, the row offsets and each call slot's tail ints
    into ``out``."""

    def __init__(self, ratio, cap):
        self.ratio, self.cap, self.calls = ratio, cap, 0

    def fn(self, out, values, n):
        self.calls += 1
        cap, r = self.cap, self.ratio
        assert len(values) == 2 * cap + 1 and 0 < n <= cap
        cu, slots = list(values[:n + 1]), list(values[cap + 1:cap + 1 + n])
        cuc, meta = [0], []
        for b in range(n):
            new = cu[b + 1] - cu[b]
            meta += [slots[b], cu[b], new, 0, cuc[-1]]
            cuc.append(cuc[-1] + new // r)
        out.copy_(torch.tensor(cu + cuc + meta, dtype=out.dtype))
