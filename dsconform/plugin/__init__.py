"""The pytest side: the options entry point, this run's state and the hypothesis profiles."""
