"""The `clipcli` command and `python -m clipcli`: Ctrl-C and SIGTERM handled from the first moment, then the app."""

import gc
import os
import signal

_STOPS = {signal.SIGINT, signal.SIGTERM}


def main() -> None:
    # Stops are blocked (held by the system) until clipcli's handlers are in place: one that came meanwhile is
    # delivered to them when unblocked, in the `try` below; before, it was Python's KeyboardInterrupt traceback.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    from clipcli._stops import exit_stopped, install_stop_handlers, stop_status

    install_stop_handlers()
    # NumPy's OpenBLAS starts a thread per core at import, which spins for a while (about 0.05 s of a core)
    # before it sleeps; clipcli runs no BLAS work that threads would help (its passes have their own workers).
    # Only the command sets this: a program that imports clipcli keeps its own.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # A run makes many objects that live to its end (modules, a few records per tensor) and few cycles.
    # Python collects every 700 net allocations, and each collection walks every young object: that cost a
    # tenth of the imports; at 100,000, one collection still walked 10,000 tensors' records (14 ms).
    # Garbage in cycles, which alone needs a collection, stays bounded by this count.
    gc.set_threshold(300_000, 20, 100)
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        from clipcli.cli import main as run  # typer and the commands: a tenth of a second
    except BaseException:
        if stop_status() is None:
            raise
        exit_stopped()
    try:
        run()
    finally:
        # Python's last collection at exit would walk every object the run made (20 ms for 10,000
        # tensors); frozen, they are left to the exit itself. Files are closed and writes done by now.
        gc.freeze()


if __name__ == "__main__":
    main()
