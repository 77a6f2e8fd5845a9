"""Errors zerofx raises for input it will not run, each naming the construct and where it came from."""

from __future__ import annotations

import os
import traceback

import torch


class CaptureError(RuntimeError):
    """The training step uses something zerofx cannot capture faithfully."""

    def __init__(self, construct: str, *, source: str | None = None, hint: str | None = None):
        self.construct = construct
        self.source = source
        self.hint = hint
        message = construct
        if source:
            message += f"\n  at {source}"
        if hint:
            message += f"\n  {hint}"
        super().__init__(message)


class RankMismatchError(RuntimeError):
    """Ranks are about to run different graphs; raised on every rank before any collective could hang."""


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or does not fit the run loading it; raised before anything is loaded."""


_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # zerofx/
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "passes") + os.sep,
)


def user_frame(tb=None) -> str | None:
    """The innermost frame of an exception's traceback (None: of the current stack) that lies in the user's code (not
    torch, not zerofx)."""
    frames = [f for f in (traceback.extract_tb(tb) if tb is not None else traceback.extract_stack())
              if not is_library_file(f.filename)]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def user_frame_from_stack_trace(stack_trace: str | None) -> str | None:
    """The innermost user frame of an FX node's recorded ``stack_trace``."""
    if not stack_trace:
        return None
    lines = stack_trace.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "'):
            filename = line.split('"')[1]
            if not is_library_file(filename):
                code = lines[i + 1].strip() if i + 1 < len(lines) else ""
                lineno = line.split("line ")[1].split(",")[0]
                return f"{filename}:{lineno}: {code}"
    return None


def raised_in_zerofx(tb) -> bool:
    """Whether the innermost frame of a traceback is zerofx's own code (a defect of zerofx, not the user's input)."""
    return os.path.abspath(traceback.extract_tb(tb)[-1].filename).startswith(_LIBRARY_DIRS[1:])


def is_library_file(filename: str) -> bool:
    """Whether ``filename`` is torch's or zerofx's, not the user's."""
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS)
