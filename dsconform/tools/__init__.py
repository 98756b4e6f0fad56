"""Tools around the suite: the air-gapped bundle."""
