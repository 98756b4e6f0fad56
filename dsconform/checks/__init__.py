"""What a result must be: the tolerance table, trace comparisons, DeepSpeed configs and reference
models."""
