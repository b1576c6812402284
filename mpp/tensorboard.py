"""A run's TensorBoard writer: SummaryWriter, but a failure to write its files (a full disk) ends
the run in one line naming the folder, as any other file the run cannot write does. mpp.train
opens it after a segment's first step (`_record`).
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Callable

from torch.utils.tensorboard import SummaryWriter


class TensorBoard:
    """A run's TensorBoard writer: SummaryWriter's calls, but a failure to write its files (a full
    disk), which TensorBoard's writer thread meets and the main thread's next call raises, is an
    OSError naming the folder (the thread's has no file name), and the thread's own traceback is not
    printed before the run's one-line error (its `threading.excepthook`, until `close`)."""

    def __init__(self, folder: Path, **kwargs):
        before = set(threading.enumerate())
        self.folder, self._writer = folder, SummaryWriter(str(folder), **kwargs)  # which starts the thread
        threads, self._hook = set(threading.enumerate()) - before, threading.excepthook

        def quiet(args) -> None:  # the writer thread's error is the main thread's to raise
            if args.thread not in threads:
                self._hook(args)
        threading.excepthook = self._quiet = quiet

    @contextlib.contextmanager
    def _named(self):
        try:
            yield
        except OSError as e:
            if e.errno is None:  # TensorBoard's own ("Writer is closed")
                raise
            raise OSError(e.errno, e.strerror, str(self.folder)) from e

    def __getattr__(self, name: str) -> Callable:
        call = getattr(self._writer, name)

        def named(*args, **kwargs):
            with self._named():
                return call(*args, **kwargs)
        return named

    def close(self) -> None:
        """Write out and close the files (raising what the writer thread met), and give the
        excepthook back."""
        try:
            with self._named():
                self._writer.close()
        finally:
            if threading.excepthook is self._quiet:
                threading.excepthook = self._hook
