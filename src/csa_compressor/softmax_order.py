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
