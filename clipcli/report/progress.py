"""The progress bar on stderr, for long work on a terminal: a bar per pass, named, with bytes and speed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, TextIO


class _Bar:
    """What a command tells its progress (`phase`, `advance`), drawn by rich."""

    def __init__(self, bar: Any):
        self.bar, self.task = bar, None

    def phase(self, label: str, total: int) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(label, total=total)

    def advance(self, n: int) -> None:
        self.bar.advance(self.task, n)


@contextlib.contextmanager
def progress_bar(stream: TextIO) -> Iterator[_Bar]:
    """A transient bar on `stream` (plain under NO_COLOR), gone when the work ends."""
    # report/ draws with rich (TID251 is waived line by line until the lint rule names report/)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(file=stream, no_color="NO_COLOR" in os.environ, highlight=False, markup=False)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, TimeRemainingColumn(), console=console, transient=True) as bar:
        yield _Bar(bar)
