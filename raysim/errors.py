"""Errors that end a run with one line on the command line (no traceback).

`ConfigError` (in raysim.config) is bad input, found before anything is written (exit 2);
`RunDiverged` is a run whose loss or model turned non-finite (exit 3): the rounds before
it are kept in the run directory, with a summary that says where it stopped."""


class RunDiverged(Exception):
    """The training loss or a model weight became NaN or infinite; the message is one line."""
