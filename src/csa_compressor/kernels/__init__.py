"""CuTe-DSL kernels of the gated pooling and the small kernels beside it, with their
launch plans and compile cache. Imports nothing above it but the leaf modules (checks,
runtime, softmax_order). The kernel-level API is csa_compressor.kernel_api."""
