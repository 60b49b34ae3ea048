"""The one exception type for bad input: a flag, a file or a checkpoint that cannot work.

Its message names the flag and the offending value; ``pretrain_gpt.py`` prints it as one line
and exits with status 2. Anything else that goes wrong is a bug and keeps its traceback.
"""


class UsageError(ValueError):
    """Bad input from the user; the message names the flag and the value."""
