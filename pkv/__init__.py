"""PersistentKV: page-aware decode scheduling over native block tables."""

__version__ = "0.1.0"
