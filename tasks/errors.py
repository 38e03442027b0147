"""Errors a user can fix: the CLI prints them as one line, without a traceback."""


class PrivPromptError(Exception):
    """Base class of errors caused by input (config, data, models, budget)."""


class ConfigError(PrivPromptError, ValueError):
    pass


class DataError(PrivPromptError, ValueError):
    pass


def user_errors() -> tuple[type[BaseException], ...]:
    """Every error class a user can fix (bad config or data, a model that cannot be loaded, an
    exhausted budget, a δ that differs from the dataset's, an unreachable endpoint): the CLI prints
    these as one line without a traceback. One list, here."""
    from pydantic import ValidationError

    from models.prompts.endpoint import EndpointError
    from models.backbones import ModelLoadError
    from privacy.ledger import (BudgetExceededError, DeltaMismatchError, LedgerError, UnitMismatchError,
                                UnknownDatasetError)

    return (PrivPromptError, ModelLoadError, BudgetExceededError, DeltaMismatchError, UnitMismatchError,
            UnknownDatasetError, LedgerError, EndpointError, ValidationError)
