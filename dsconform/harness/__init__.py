"""The rank harness: run_ranks and its errors, worker pools, standby ranks, lanes, launcher mode,
batches."""
