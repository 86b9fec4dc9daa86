"""For probe subprocesses: count the kernel compiles a process runs (kernels.compile._compile)."""

from csa_compressor.kernels import compile as cc


def count_compiles() -> list:
    """Patch compile._compile to record each call; the returned list grows by one a compile."""
    compiled = []
    real = cc._compile

    def counting(*a, **k):
        compiled.append(1)
        return real(*a, **k)

    cc._compile = counting
    return compiled
