# The project's own tests. pytester runs small pytest sessions against the plugin in-process.
pytest_plugins = ["pytester"]
