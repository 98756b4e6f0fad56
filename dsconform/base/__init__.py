"""What every layer needs: version order, the pairwise covering array of a matrix's tiers,
DeepSpeed's API differences between releases, features removed upstream, the extensions cache's
stale build locks, fd capture, py-cpuinfo's shared answer. Imports nothing of dsconform but the
foundations."""
