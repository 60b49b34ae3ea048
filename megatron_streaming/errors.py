"""The exception types a user sees as one message instead of a traceback.

``UsageError``: bad input (a flag, a file, a checkpoint that cannot work); the message names
the flag and the offending value; ``pretrain_gpt.py`` exits with status 2. ``JobFailure``: the
run broke (a lost peer, a full disk); status 3. Anything else is a bug and keeps its traceback.
"""


class UsageError(ValueError):
    """Bad input from the user; the message names the flag and the value."""


class ConfigError(UsageError):
    """A flag value that cannot work; the message names the flag and the value."""


class JobFailure(RuntimeError):
    """The job cannot go on (a lost or stuck peer, an unwritable checkpoint); the message
    says what happened and what to resume from. ``pretrain_gpt.py`` prints it and exits 3."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name where it has none: what a
    one-line report quotes of an error from below (a store, a file, a tokenizer)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
