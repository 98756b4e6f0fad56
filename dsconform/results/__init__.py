"""Results: records in one format, the summary, comparisons, cluster aggregation and their
rendering."""
