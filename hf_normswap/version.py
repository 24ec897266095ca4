"""The package version, recorded in every checkpoint's config.json and its remote code."""

__version__ = "0.1.0"
