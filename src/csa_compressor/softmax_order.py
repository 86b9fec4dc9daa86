"""The orders in which torch's CUDA kernels sum a window: its softmax (the denominator and
the backward's S) and its reduce kernel (the eager region's ``(v * w).sum(dim=1)``), and
ordered_sum, which adds in such an order: the fused kernels (unrolled at trace time) and
the explicit reference (on tensors) both sum through it, so that their outputs and
gradients are torch's, bit for bit."""


def torch_softmax_lanes(num_slots: int, head_dim: int) -> int:
    """How many strided lanes torch's CUDA softmax (its forward denominator and its
    backward sum alike) splits a window of ``num_slots`` into, for rows of ``head_dim``
    channels after the window dimension. Its spatial kernel gives the window dimension
    threads only for rows of 64 channels or fewer and windows of 64 slots or more, as many
    as fit 1024 threads (a power of two): lane j sums slots j, j + lanes, ... in order,
    then the lanes meet in a halving tree. 1 means one serial sum in slot order."""
    inner = min(head_dim, 1024)
    lanes = 1
    if inner <= 64 and num_slots >= 64:
        while inner * lanes <= 1024 and lanes <= num_slots:
            lanes *= 2
        lanes //= 2
    return lanes


# torch's CUDA reduce kernel (the eager region's ``(v * w).sum(dim=1)``): each thread adds
# its j-th slot into accumulator j % 4 and meets the four in order.
SUM_ACCUMULATORS = 4
_REDUCE_THREADS = 512
_WARP = 32


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def torch_sum_lanes(num_rows: int, num_slots: int, head_dim: int) -> int:
    """How many strided lanes torch's CUDA sum over the window dimension of a contiguous
    fp32 ``(num_rows, num_slots, head_dim)`` tensor splits each window into (its reduce
    kernel's block height when it splits the input, else 1). Lane j adds slots j,
    j + lanes, ... into SUM_ACCUMULATORS accumulators in turn and meets them in order;
    the lanes then meet in a halving tree. Measured bit for bit on the H200 against
    torch 2.11 over rows 1-8192, windows 2-512 and head_dim 64-576
    (tools/torch_sum_order_probe.py)."""
    out_vec = next(v for v in (4, 2, 1) if head_dim % v == 0)
    threads = _REDUCE_THREADS // out_vec
    dim0 = max(1, num_rows * head_dim // out_vec)
    dim0_pow2 = _last_pow2(dim0) if dim0 < threads else threads
    dim1_pow2 = _last_pow2(num_slots) if num_slots < threads else threads
    width = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, threads // width)
    if num_slots >= height * 16 or num_slots >= 256:
        return height
    return 1


def torch_sum_lanes_by_rows(num_slots: int, head_dim: int) -> list:
    """``[(most_rows, lanes), ...]``: torch_sum_lanes for every row count, as row ranges in
    increasing order (the last ``most_rows`` None: no bound). Only packs of a few rows
    (fewer than 32 vectors of outputs) differ from the many-row count."""
    ranges = []
    rows = 1
    while True:
        lanes = torch_sum_lanes(rows, num_slots, head_dim)
        if rows * head_dim >= _WARP * 4:  # from here on the reduce block is a warp wide
            ranges.append((None, lanes))
            break
        if ranges and ranges[-1][1] == lanes:
            ranges[-1] = (rows, lanes)
        else:
            ranges.append((rows, lanes))
        rows += 1
    if len(ranges) > 1 and ranges[-2][1] == ranges[-1][1]:
        ranges[-2:] = [(None, ranges[-1][1])]
    return ranges


def ordered_sum(load, n: int, lanes: int, ahead: int, accumulators: int = 1):
    """The sum of ``load(0) .. load(n - 1)`` unrolled at trace time, in one of torch's
    orders. Lane j takes slots j, j + lanes, ... in order, adding its m-th into
    accumulator m % ``accumulators`` and meeting those in order (torch's reduce kernel
    keeps 4; its softmax 1, a serial sum); ``lanes > 1``: the lanes then meet in a
    halving tree (lane j + lane j + half, half = lanes/2, lanes/4, ...), evaluated depth
    first, a lane's sum just before its add, so a thread holds log2(lanes) partial sums
    rather than ``lanes``. Each load is issued ``ahead`` terms before its add
    (the long kernels' LONG_SUM_AHEAD in shared memory): a loop of 8 loads then 8 adds made every 8 adds
    wait a shared-memory latency."""
    levels = lanes.bit_length() - 1

    def lanes_under(t, j):  # the lanes of tree node (level t, lane j), in evaluation order
        return [j] if t == 0 else lanes_under(t - 1, j) + lanes_under(t - 1, j + (lanes >> t))

    order = [k for j in lanes_under(levels, 0) for k in range(j, n, lanes)]
    ring = [load(order[i]) for i in range(min(ahead, n))]
    taken = [0]

    def take():
        i = taken[0]
        x = ring[i % ahead]
        if i + ahead < n:
            ring[i % ahead] = load(order[i + ahead])
        taken[0] = i + 1
        return x

    def lane(j):
        acc = []
        for m, _ in enumerate(range(j, n, lanes)):
            if m < accumulators:
                acc.append(take())
            else:
                acc[m % accumulators] = acc[m % accumulators] + take()
        total = acc[0]
        for a in acc[1:]:
            total = total + a
        return total

    def node(t, j):
        if t > 0:
            if j + (lanes >> t) >= n:  # a lane past the window adds torch's zero: exact
                return node(t - 1, j)
            return node(t - 1, j) + node(t - 1, j + (lanes >> t))
        return lane(j)

    return node(levels, 0)


# torch's CUDA reduce kernel over the last dim of a contiguous fp32 (N, d) tensor (the
# epilogue's ``x.pow(2).mean(-1)`` and ``(g * x).sum(-1)``), for N >= ROWSUM_MIN_ROWS: one
# warp a row. Measured bit for bit on the H200 against torch 2.11 over N 16-24576 and d
# 32-1024 (tools/torch_rowsum_order_probe.py): rows of 128 values or more are read as
# 4-wide vectors, shorter rows (96 included) one value at a time.
ROWSUM_MIN_ROWS = 16  # fewer output rows give a row more than a warp
ROWSUM_VEC = 4
ROWSUM_WARP_OFFSETS = (16, 8, 4, 2, 1)  # the warp's shfl_down combine


def torch_rowsum_vec(head_dim: int) -> int:
    """How torch's reduce reads a row of ``head_dim`` fp32 values: 1 (lane t takes values
    t, t + 32, ..., its j-th into accumulator j % 4) below 128, ROWSUM_VEC from 128 (lane
    t takes vectors t, t + 32, ..., element i into accumulator i). The accumulators then
    meet in order and the lanes in ROWSUM_WARP_OFFSETS; the mean is that sum times
    fl(N) / fl(N * d)."""
    return ROWSUM_VEC if head_dim >= 128 else 1


# torch's CUDA reduce kernel over the first dim of a contiguous fp32 (N, d) tensor, d a
# multiple of 4 (the norm weight's gradient, ``prod.sum(0)``): Reduce.cuh's
# setReduceConfig for a reduction over the slow dimension, 4-wide output vectors. Measured
# bit for bit on the H200 against torch 2.11 over N 16-24576 and d 64-512
# (tools/torch_colsum_order_probe.py).
COLSUM_VEC = 4
_COLSUM_MIN_VALUES, _COLSUM_MAX_VALUES = 16, 256  # Reduce.cuh's values a thread


def torch_colsum_order(rows: int, head_dim: int, sms: int, threads_per_sm: int) -> tuple:
    """``(lanes, ctas)`` of torch's column sum of a contiguous fp32 ``(rows, head_dim)``
    tensor on a GPU of ``sms`` SMs of ``threads_per_sm`` threads: lane y of CTA c adds rows
    y + lanes*c + k*lanes*ctas, its k-th into accumulator k % SUM_ACCUMULATORS, the
    accumulators met in order; the lanes meet in a halving tree (y takes y + off, off =
    lanes/2 .. 1); with ctas > 1 lane y then adds the CTAs' results c = y, y + lanes, ...
    to zero and the same tree follows. ``(1, 1)``: one thread walks every row."""
    if rows < 1 or head_dim < COLSUM_VEC or head_dim % COLSUM_VEC:
        raise ValueError(f"torch_colsum_order: rows >= 1 and head_dim a multiple of "
                         f"{COLSUM_VEC}, got ({rows}, {head_dim})")
    limit = _REDUCE_THREADS // COLSUM_VEC  # the thread limit is shared by a vector's outputs
    outs = head_dim // COLSUM_VEC
    p0 = _last_pow2(outs) if outs < limit else limit
    p1 = _last_pow2(rows) if rows < limit else limit
    width = min(p0, _WARP)
    lanes = min(p1, limit // width)
    width = min(p0, limit // lanes)
    if rows < min(lanes * _COLSUM_MIN_VALUES, _COLSUM_MAX_VALUES):
        return 1, 1  # the block's rows take other outputs: one thread a column vector
    per_thread = -(-rows // lanes)
    grid = -(-outs // width)
    target = sms * (threads_per_sm // (width * lanes))
    ctas = 1
    if per_thread >= _COLSUM_MAX_VALUES and grid <= target:
        ctas = max(min(-(-target // grid), -(-per_thread // _COLSUM_MIN_VALUES)),
                   -(-per_thread // _COLSUM_MAX_VALUES))
    return lanes, ctas


def colsum_in_order(x, lanes: int, ctas: int):
    """``x.sum(0)`` of a 2-D fp32 tensor added in torch_colsum_order's order (torch ops, one
    add at a time): what the column-sum kernel must equal, for tests on any device."""
    rows = x.shape[0]

    def lane(first, step):
        acc = [x.new_zeros(x.shape[1:]) for _ in range(SUM_ACCUMULATORS)]
        for k, r in enumerate(range(first, rows, step)):
            acc[k % SUM_ACCUMULATORS] = acc[k % SUM_ACCUMULATORS] + x[r]
        total = acc[0]
        for a in acc[1:]:
            total = total + a
        return total

    def tree(vals):
        vals = list(vals)
        off = len(vals) // 2
        while off:
            for y in range(off):
                vals[y] = vals[y] + vals[y + off]
            off //= 2
        return vals[0]

    step = lanes * ctas
    parts = [tree(lane(y + lanes * c, step) for y in range(lanes)) for c in range(ctas)]
    if ctas == 1:
        return parts[0]
    finals = []
    for y in range(lanes):
        v = x.new_zeros(x.shape[1:])
        for c in range(y, ctas, lanes):
            v = v + parts[c]
        finals.append(v)
    return tree(finals)
