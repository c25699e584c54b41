"""The package's version, in the one place it is stated (pyproject.toml reads it from here)."""

__version__ = "0.1.0"
