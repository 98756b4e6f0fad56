# The project's own tests. pytester runs small pytest sessions against the plugin in-process.
import distutils.ccompiler

pytest_plugins = ["pytester"]

# pytester restores sys.modules after each in-process run, so a module first imported inside one
# is dropped afterwards. setuptools' distutils finds its compilers as subclasses of one base class:
# imported inside a run, then re-imported, the base class has no 'unix' compiler any more, and
# DeepSpeed's op probe (OpBuilder.has_function) reports every op incompatible for the rest of the
# session. Importing the compilers here, before any run, keeps them in place.
distutils.ccompiler.new_compiler()
