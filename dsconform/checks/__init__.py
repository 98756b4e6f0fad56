"""What a result must be: the tolerance table, trace comparisons, DeepSpeed configs, ZeRO
against DDP, the collectives' calls and expected values, and the reference models."""
