"""The node as it is: what hardware it has (counted without torch), per-GPU health and NCCL's
settings."""
