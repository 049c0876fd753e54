"""pflbed's version, in a module of its own so that any layer can record it without importing the package's
`__init__` (which imports the engine lazily for `pflbed.run`)."""

__version__ = "0.1.0"
