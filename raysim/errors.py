"""Errors that end a run with one line on the command line (no traceback).

`ConfigError` is bad input, found before anything is written (exit 2);
`RunDiverged` is a run whose loss or model turned non-finite (exit 3): the rounds before
it are kept in the run directory, with a summary that says where it stopped (`RunStalled`,
an asynchronous run to which no update can arrive, ends the same way); `WriteFailed`
is a run directory that could not be written (a full disk): exit 1, the last good
checkpoint named. `StartFailed` is Ray not starting on this machine (exit 1: not the
input's fault; retry)."""


class ConfigError(Exception):
    """A user-facing configuration or input problem; its message is one line."""


class RunDiverged(Exception):
    """The training loss or a model weight became NaN or infinite; the message is one line."""


class RunStalled(RunDiverged):
    """An asynchronous run that cannot progress: no client can start, or none stays online
    long enough for its update to arrive; the message is one line."""


class ActorsLost(RunDiverged):
    """Every client actor was lost and none came back (a cluster that lost its workers): the
    round cannot finish; the message is one line."""


class WriteFailed(Exception):
    """A run file could not be written (no space left, quota, I/O error); the message is one
    line naming the file and the last checkpoint a resume can start from."""


class NothingToDo(Exception):
    """`resume=` of a run that already finished all its rounds: nothing runs, nothing is
    rewritten; the message says so (exit 0)."""

    def __init__(self, message: str, run_dir: str = ""):
        super().__init__(message)
        self.run_dir = run_dir


class StartFailed(Exception):
    """A local Ray did not start (a time-out waiting for its processes on a loaded machine):
    not bad input, so exit 1; the message is one line saying where Ray's logs are."""
