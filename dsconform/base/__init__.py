"""What every layer needs: version order, DeepSpeed's API differences between releases,
features removed upstream, the extensions cache's stale build locks. Imports nothing of
dsconform but the foundations."""
