"""A file object for h5py's file-object driver that holds a failed write back until HDF5 has closed the file."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any


class HDF5Writes(io.RawIOBase):
    """The file HDF5 writes a store's layout through (h5py's file-object driver), with failures held back.

    The first failed write or truncate (full disk, quota, file size limit) is kept in ``error`` and every
    later one only pretends, so HDF5 still closes the file normally and the caller raises ``error``
    afterwards. HDF5 left with a file it could not flush fails to close it (``RuntimeError``) and then
    crashes the interpreter at exit.

    Example:
        >>> fh = HDF5Writes(tmp)  # doctest: +SKIP
        >>> with h5py.File(fh, "w") as f:  # doctest: +SKIP
        ...     f.create_dataset("x", data=[1, 2, 3])
        >>> fh.close()  # doctest: +SKIP
        >>> if fh.error is not None:  # doctest: +SKIP
        ...     raise fh.error
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        self.pos = 0
        self.error: OSError | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos}.get(whence)
        self.pos = (os.fstat(self.fd).st_size if base is None else base) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        data = os.pread(self.fd, len(buffer), self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size, offset = len(view), self.pos
        if self.error is None:
            try:
                while view:
                    done = os.pwrite(self.fd, view, offset)
                    view, offset = view[done:], offset + done
            except OSError as err:
                self.error = err
        self.pos += size
        return size

    def truncate(self, size: int | None = None) -> int:
        size = self.pos if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as err:
                self.error = err
        return size

    def flush(self) -> None:
        pass  # every write went straight to the file

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        super().close()
