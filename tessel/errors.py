"""The one base class of errors caused by the user's input.

The CLI prints such an error as one line and exits with code 2; anything else is a bug and
keeps its traceback.
"""


class TesselError(ValueError):
    """Bad input (config, data, checkpoint, run directory); the message is one line that
    says what is wrong and how to fix it."""

    exit_code = 2


class DataError(TesselError):
    """Unusable data (missing, corrupt, or not matching the model or tokenizer)."""


class TokenizerError(TesselError):
    """An unusable tokenizer (spec, file or setting)."""


class CollectiveTimeout(TesselError):
    """A collective failed or hung (a peer process died or stopped responding). Not bad
    input: the CLI exits with code 3 so job scripts can tell it apart and restart."""

    exit_code = 3


class Stopped(BaseException):
    """A stop signal (SIGTERM) that arrived where there is nothing to save yet, while the
    data is being prepared: the command ends at once, with one line and exit code 128 + the
    signal's number, as a process killed by it would. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int, during: str):
        import signal

        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name} while {during}, before "
                         "training (nothing to save; what was half prepared is discarded)")
