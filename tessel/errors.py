"""The one base class of errors caused by the user's input.

The CLI prints such an error as one line and exits with code 2; anything else is a bug and
keeps its traceback.
"""


class TesselError(ValueError):
    """Bad input (config, data, checkpoint, run directory); the message is one line that
    says what is wrong and how to fix it."""


class DataError(TesselError):
    """Unusable data (missing, corrupt, or not matching the model or tokenizer)."""
