"""The package's version, written into every commit marker (``writer``); pyproject.toml states the same number."""
__version__ = "0.1.0"
