"""The one exception type for bad user input (files, flags, CSV rows).

Scripts catch it at the top level (see :func:`utils.cli.run_main`) and print its
message as one line, so a user sees what is wrong and where, not a traceback.
"""


class TaskHetError(Exception):
    """Bad input: the message names the file, row or flag and what was expected."""


class NonFiniteLossError(TaskHetError):
    """A training loss became NaN or infinite; the run must stop (it keeps its last good checkpoint)."""
