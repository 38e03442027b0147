"""Errors a user can fix: the CLI prints them as one line, without a traceback."""


class PrivPromptError(Exception):
    """Base class of errors caused by input (config, data, models, budget)."""


class ConfigError(PrivPromptError, ValueError):
    pass


class DataError(PrivPromptError, ValueError):
    pass
