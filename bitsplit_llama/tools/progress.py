"""Progress display for long work (split, eval): a rich bar on a terminal, nothing otherwise."""

from __future__ import annotations

import sys


class NullProgress:
    def phase(self, name: str, total_tensors: int, total_bytes: int) -> None:
        pass

    def advance(self, tensors: int = 0, nbytes: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


class RichProgress:
    """Tensors and bytes of the current phase, drawn on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._console = Console(stderr=True)
        self._p = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
            TextColumn("{task.fields[bytes]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self._console, transient=False,
        )
        self._task = None
        self._bytes_total = 0
        self._bytes_done = 0
        self._p.start()

    def _fmt_bytes(self) -> str:
        if not self._bytes_total:
            return ""
        return f"{self._bytes_done / 2**20:,.0f}/{self._bytes_total / 2**20:,.0f} MiB"

    def phase(self, name: str, total_tensors: int, total_bytes: int) -> None:
        if self._task is not None:
            self._p.update(self._task, completed=self._p.tasks[-1].total)
        self._bytes_total, self._bytes_done = total_bytes, 0
        self._task = self._p.add_task(name, total=total_tensors, bytes=self._fmt_bytes())

    def advance(self, tensors: int = 0, nbytes: int = 0) -> None:
        if self._task is None:
            return
        self._bytes_done += nbytes
        self._p.update(self._task, advance=tensors, bytes=self._fmt_bytes())

    def close(self) -> None:
        self._p.stop()


def make_progress(quiet: bool) -> RichProgress | NullProgress:
    if quiet or not sys.stderr.isatty():
        return NullProgress()
    return RichProgress()
