"""For probe subprocesses: count the kernel compiles a process runs (kernels.jit.compile_kernel)."""

from csa_compressor.kernels import jit


def count_compiles() -> list:
    """Patch jit.compile_kernel to record each call; the returned list grows by one a compile."""
    compiled = []
    real = jit.compile_kernel

    def counting(*a, **k):
        compiled.append(1)
        return real(*a, **k)

    jit.compile_kernel = counting
    return compiled
