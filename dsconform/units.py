"""Units, defined once. Code counts bytes and seconds; GB/s means 1e9 bytes per second
everywhere (nccl-tests' and fio's convention), GiB is 2**30 bytes (memory sizes)."""

GB = 1e9
GIB = 1 << 30
TFLOPS = 1e12  # floating-point operations per second, matmul throughput
