# Thin on purpose: everything lives in the plugin (fixtures/plugin.py) and the library (dsconform/).
pytest_plugins = ["fixtures.plugin"]
