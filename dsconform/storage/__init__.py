"""Where the suite writes: NVMe paths, DeepNVMe I/O and tuning, cross-checks, the checkpoint
disk."""
