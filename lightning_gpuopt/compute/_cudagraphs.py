"""Whether compiled steps replay CUDA graphs: the skips torch counts while it compiles and first runs them,
and the reasons it logs ("skipping cudagraphs due to ...")."""

from __future__ import annotations

import logging
import os
import re

from lightning_gpuopt._compat import compiled_frame_count, cudagraph_skip_count, cudagraph_skip_logger

__all__ = ["SkipWatch", "skip_reason"]

# torch's own lead-in, once or twice ("cudagraphs" backend: "skipping cudagraphs due to skipping ...")
_LEAD = re.compile(r"^(?:(?:skipping|disabling) cudagraphs?(?: for backward)? due to )+", re.IGNORECASE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def skip_reason(message: str) -> str:
    """torch's skip message as one line: its reason, and the last line of code torch names for it.

    Example:
        >>> skip_reason('skipping cudagraphs due to mutated inputs (1 instances). Found from : \\n'
        ...             '  File "/home/u/model.py", line 12, in forward\\n    x.mul_(2)')
        'mutated inputs (1 instances) at model.py:12'
        >>> skip_reason("skipping cudagraphs due to skipping cudagraphs due to cpu device (primals_1)")
        'cpu device (primals_1)'
    """
    head, _, trace = message.partition(". Found from")
    lines = head.strip().splitlines()
    reason = _LEAD.sub("", lines[0] if lines else "").strip().rstrip(".")
    frames = _FRAME.findall(trace)
    if frames:
        path, line = frames[-1]
        reason += f" at {os.path.basename(path)}:{line}"
    return reason


class SkipWatch(logging.Handler):
    """The CUDA graph skips torch records from construction to ``stop()`` (a counter read twice), with their
    ``reasons`` as torch logged them, and whether dynamo ``compiled`` anything in between."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []
        self.compiled: bool | None = None
        self._start, self._frames = cudagraph_skip_count(), compiled_frame_count()
        self._logger = cudagraph_skip_logger()
        if self._logger is not None:
            self._logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "cudagraph" in message and " due to " in message:
            self.reasons.append(skip_reason(message))

    def stop(self) -> int | None:
        """The skips counted since the start (``None`` where this torch keeps no count); safe to call twice."""
        if self._logger is not None:
            self._logger.removeHandler(self)
        self._logger = None
        start, self._start = self._start, None
        frames, self._frames = self._frames, None
        now, frames_now = cudagraph_skip_count(), compiled_frame_count()
        if frames is not None and frames_now is not None:
            self.compiled = frames_now != frames
        if start is None or now is None:
            return None
        return now - start if now >= start else now  # a count reset in between counts from zero
