"""DeepSpeed ops for real: the build cache and its locks, building, loading, checking and
diagnosing them."""
