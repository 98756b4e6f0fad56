"""dsconform: acceptance tests that tell whether a node, a cluster or a DeepSpeed upgrade trains
correctly and as fast as its hardware profile promises."""

__version__ = "0.1.0"
