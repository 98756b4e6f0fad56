"""What decides whether a test runs, skips or fails: requires(), tiers, known issues, removed
features, versions."""
