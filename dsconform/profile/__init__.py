"""Hardware profiles: the schema and its loading, which profile a run is held to, and writing
one."""
