"""The `clipcli` command: the app with its commands registered, run with the contract's exit statuses."""

import sys

from clipcli import cli_commands, cli_trust  # noqa: F401  (they register their commands, in the order --help lists them)
from clipcli._stops import exit_stopped, ignore_stops_if_committed, install_stop_handlers, stop_status
from clipcli.cli_app import app, app_for

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """The console script (and `python -m clipcli`): runs the app; exits with the contract's status.

    Ctrl-C and SIGTERM stop a command with its temporary files removed and the target untouched, wherever they
    arrive before the output starts to replace its target: a signal whose exception Python swallowed on the way
    (in an at-fork hook, a `__del__`) or turned into another (an import's) still keeps the write from being
    committed. The process then ends by the signal itself (`exit_stopped`). From the commit on a stop is held and
    dropped: the command runs to its end.
    """
    install_stop_handlers()
    announced = False
    try:
        app_for(sys.argv[1:] if argv is None else argv)(args=argv, prog_name="clipcli")
    except SystemExit as e:
        announced = e.code == stop_status()  # the command's `_errors` said it
        if stop_status() is None:
            raise
    except BaseException:  # before a command started or after it ended, or as an import's error
        if stop_status() is None:
            raise
    finally:
        ignore_stops_if_committed()  # the output is in place: a stop on the way out must not end it by the signal
    if stop_status() is not None:
        exit_stopped(announce=not announced)
