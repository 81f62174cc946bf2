"""The pack's two errors, in a module that imports nothing (every layer may raise them)."""


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the setting, the value and what is allowed."""


class StateError(RuntimeError):
    """A checkpoint's pack state is unreadable or inconsistent (integrity failure: the run must stop)."""
