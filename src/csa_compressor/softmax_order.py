"""The order in which torch's CUDA softmax sums a window: the fused kernels and the
explicit reference follow it so that their gradients are torch's, bit for bit."""


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
