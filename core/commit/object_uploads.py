"""Files of a local spool going up to an object store while the engine writes them: a file larger
than one PUT as a multipart upload, part by part as the engine makes it final (`_Stream`), a
smaller one in one PUT once whole. One `Uploads` serves a command's output
(`core.commit.object_staging`) and a live save's rank (`hpckpt.dist`).

The engine tells `filled(name, upto)`: bytes `[0, upto)` of `name` are final, `upto` its size
once it is filled (`core.io.engine`). An upload that fails, or is cancelled because the write
failed, is aborted: no object, no unfinished multipart upload. A `held` file streams like the
others but its upload is completed only by `complete(name)` (a single-file output, which may not
exist before its sidecars).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from hpckpt.core.errors import HpckptError
from hpckpt.core.storage.object_store import SINGLE_PUT, UPLOAD_CONCURRENCY, UPLOAD_PART

#: A streamed upload reads the spool this much at a time into the part being filled.
STREAM_PIECE = 1 << 20
#: Files going up at once, at most; `memory` (the part of `--max-memory` that is not the engine's:
#: `core.io.write`) is shared between them as parts in flight (`core.storage.object_store`).
UPLOAD_FILES = 2
DEFAULT_MEMORY = UPLOAD_FILES * UPLOAD_PART * UPLOAD_CONCURRENCY


class Uploads:
    """Uploads of the files in `spool` to `key_of(name)`, holding about `memory` bytes in all:
    as many files at once as it holds at two parts each (one going up, the next being filled),
    at most `files`, each with its share as parts in flight; `announce(name)` is called before a
    file starts going up."""

    def __init__(self, store, spool: Path, key_of: Callable[[str], str], *, memory: int = DEFAULT_MEMORY,
                 files: int = UPLOAD_FILES, announce: Callable[[str], None] | None = None,
                 held: tuple[str, ...] = ()):
        self.store, self.spool, self.key_of = store, spool, key_of
        self.files = max(1, min(files, memory // (2 * UPLOAD_PART)))
        self.memory = max(2 * UPLOAD_PART, memory // self.files)
        self.announce = announce or (lambda name: None)
        self.held = set(held)
        self.uploaded: list[str] = []  # begun (an upload that failed may still have landed)
        self._done: dict[str, tuple[int, int]] = {}  # up: name -> (size, mtime) of the spool's copy then
        self._streams: dict[str, _Stream] = {}
        self._pending: list[Future] = []
        self._completing: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def filled(self, name: str, upto: int) -> None:
        stream = self._streams.get(name)
        if stream is None:
            size = (self.spool / name).stat().st_size  # (created at its final size)
            held = name in self.held
            if upto < size and (size <= SINGLE_PUT or upto < UPLOAD_PART) or (held and upto >= size):
                return  # whole, later (`upload`)
            if upto >= size:
                self._pending.append(self._submit(self._whole, name))
                return
            stream = self._streams[name] = _Stream(size, held)  # (one engine worker fills a file)
            future = self._submit(self._stream, name, stream)
            (self._completing.__setitem__(name, future) if held else self._pending.append(future))
        stream.advance(upto)

    def _submit(self, fn, *args) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.files, thread_name_prefix="hpckpt-upload")
        return self._pool.submit(fn, *args)

    def _whole(self, name: str) -> None:
        st = (self.spool / name).stat()
        self.announce(name)
        self.upload(name)
        self._done[name] = (st.st_size, st.st_mtime_ns)

    def _stream(self, name: str, stream: "_Stream") -> None:
        self.announce(name)
        self.uploaded.append(name)
        with open(self.spool / name, "rb", buffering=0) as f, self.store.writer(self.key_of(name), self.memory) as write:
            done = 0
            while done < stream.size:
                ready = stream.wait(done)
                while done < ready:
                    piece = f.read(min(STREAM_PIECE, ready - done))
                    if not piece:
                        raise HpckptError(f"{self.spool / name}: the spool file ended early")
                    write(piece)
                    done += len(piece)
            stream.wait_release()  # (the object exists once the block ends)
        st = (self.spool / name).stat()
        self._done[name] = (st.st_size, st.st_mtime_ns)

    def upload(self, name: str) -> None:
        """`name` up now, whole (multipart if large)."""
        self.uploaded.append(name)
        self.store.upload(self.key_of(name), self.spool / name, self.memory)

    def upload_rest(self, names: list[str]) -> None:
        """Wait for the uploads begun, then upload those of `names` that are not up as the spool
        has them, `files` at once."""
        self.finish()
        rest = [n for n in names if not self.unchanged(n)]
        with ThreadPoolExecutor(max(1, min(self.files, len(rest)))) as pool:
            list(pool.map(self.upload, rest))

    def finish(self) -> None:
        """Wait for the uploads begun (but held ones); their errors are raised here."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def complete(self, name: str) -> bool:
        """Complete held file `name`'s streamed upload; False when it was not streamed."""
        future = self._completing.pop(name, None)
        if future is None:
            return False
        self._streams[name].release()
        future.result()
        return True

    def unchanged(self, name: str) -> bool:
        """Up already, and the spool's copy not written since (else it goes up again)."""
        if name not in self._done:
            return False
        st = (self.spool / name).stat()
        return self._done[name] == (st.st_size, st.st_mtime_ns)

    def cancel(self) -> None:
        """The write failed: abort the streams, wait for every upload to end."""
        for stream in self._streams.values():
            stream.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class _Stream:
    """How far the engine has made a file final, for the upload that follows it: whole parts
    are handed over as they become final, the rest once the file is filled."""

    def __init__(self, size: int, held: bool = False):
        self.size = size
        self._upto = 0
        self._cancelled = False
        self._held = held  # completed only once released (`Uploads.complete`)
        self._changed = threading.Condition()

    def advance(self, upto: int) -> None:
        with self._changed:
            if upto > self._upto:
                self._upto = upto
                self._changed.notify()

    def release(self) -> None:
        with self._changed:
            self._held = False
            self._changed.notify()

    def cancel(self) -> None:
        with self._changed:
            self._cancelled = True
            self._changed.notify()

    def wait(self, done: int) -> int:
        """Where the upload may read up to, beyond `done`: whole parts, or the end."""
        with self._changed:
            while True:
                self._check()
                if self._upto >= self.size:
                    return self.size
                whole = done + (self._upto - done) // UPLOAD_PART * UPLOAD_PART
                if whole > done:
                    return whole
                self._changed.wait()

    def wait_release(self) -> None:
        with self._changed:
            while self._held and not self._cancelled:
                self._changed.wait()
            self._check()

    def _check(self) -> None:
        if self._cancelled:
            raise HpckptError("the write failed: its upload is abandoned")
