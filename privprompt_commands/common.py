"""What every command shares: the user errors it reports in one line."""

from __future__ import annotations

import argparse
import sys


def _user_errors() -> tuple[type[BaseException], ...]:
    from tasks.errors import user_errors

    return user_errors()


def _quiet_user_error_tracebacks(errors) -> None:
    """Log records about a user error (bad input, exhausted budget) carry no traceback: the CLI
    prints the error as one line. Bugs keep their tracebacks. Done in the record factory, so it
    holds for every logger and for handlers Prefect configures later."""
    import logging

    base = logging.getLogRecordFactory()
    if getattr(base, "_privprompt", False):
        return

    def factory(*args, **kwargs):
        record = base(*args, **kwargs)
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and isinstance(exc, errors):
            record.exc_info, record.exc_text = None, None
        return record

    factory._privprompt = True
    logging.setLogRecordFactory(factory)


def _fail(message: str) -> int:
    print(f"privprompt: error: {message}", file=sys.stderr)
    return 2


def _one_line(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err).strip() else ""
    return text or type(err).__name__


def _positive_int(value: str) -> int:
    """An argparse type: an integer of at least 1 (a refusal is argparse's one line)."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number
