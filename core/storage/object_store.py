"""One bucket of an object store, through obstore (the Python binding of the Rust `object_store`
crate): ranged reads issued concurrently, multipart uploads in parallel, conditional creates,
S3, GCS and Azure in one package, with retries and backoff built in (docs/object-storage.md).

Settings come from the standard places: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL` (an `http://` endpoint is allowed as given),
`AWS_PROFILE` (read through boto3, when installed), and the `GOOGLE_*` / `AZURE_*` variables of
the other stores. Retries: `HPCKPT_STORE_RETRIES` (default 10) within
`HPCKPT_STORE_RETRY_SECONDS` (default 180) per request.

Every error of the client becomes one of hpckpt's: a missing object `MissingFileError` (exit 8),
anything else the store said or could not say (no such bucket, access denied, no answer)
`StorageError` (exit 27), with the store's own words trimmed to one line.
"""

from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple, TypeVar

from hpckpt.core.errors import (
    CorruptDataError,
    ExtraNotInstalledError,
    HpckptError,
    MissingFileError,
    StorageError,
    UsageError,
)

#: Reads larger than this go out as ranged GETs of this size, up to `READS_IN_FLIGHT` at once.
READ_PIECE, READS_IN_FLIGHT = 16 << 20, 8
#: Objects up to this size are read whole, once, and kept (the last `SMALL_CACHED` of them): a
#: `.metadata` is sniffed, then read; a small file's header and data are two reads.
SMALL_OBJECT, SMALL_CACHED = 1 << 20, 64
#: ... and of a larger object, its first `HEAD_BYTES` (where every format keeps its header).
HEAD_BYTES = 64 << 10
#: Multipart uploads: part size and parts in flight per object (their product bounds the memory);
#: a file up to `SINGLE_PUT` goes up in one request (fewer requests, no parts to assemble).
UPLOAD_PART, UPLOAD_CONCURRENCY, SINGLE_PUT = 8 << 20, 4, 16 << 20

T = TypeVar("T")


class ObjectInfo(NamedTuple):
    """An object as listed: its size and entity tag (every read of it is conditional on the tag,
    so an object replaced while a command reads it is an error, never a mix of two versions)."""

    size: int
    etag: str | None
    mtime: float = 0.0  # last modified, seconds since the epoch


_STORES: dict[tuple[str, str], "ObjectStore"] = {}
_STORES_LOCK = threading.Lock()


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ExtraNotInstalledError(
            "URLs need hpckpt's object-store client, which is not installed",
            hint="pip install 'hpckpt[s3]' (local paths work without it)") from None
    return obstore


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number") from None


def connect(scheme: str, bucket: str) -> "ObjectStore":
    """The store of `scheme://bucket`, one per process (its listings are cached)."""
    with _STORES_LOCK:
        store = _STORES.get((scheme, bucket))
        if store is None:
            store = _STORES[(scheme, bucket)] = ObjectStore(scheme, bucket)
        return store


def forget_stores() -> None:
    """Drop every connection and cached listing (tests that restart the server)."""
    with _STORES_LOCK:
        _STORES.clear()


class ObjectStore:
    """A bucket: listings cached per prefix, and every call's errors turned into hpckpt's."""

    def __init__(self, scheme: str, bucket: str):
        obstore = _obstore()
        from obstore.store import from_url

        self.scheme, self.bucket = scheme, bucket
        self.url_root = f"{scheme}://{bucket}"
        self._ob = obstore
        options: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            options["allow_http"] = True
        retry = {"max_retries": int(_number("HPCKPT_STORE_RETRIES", 10)),
                 "retry_timeout": timedelta(seconds=_number("HPCKPT_STORE_RETRY_SECONDS", 180))}
        kwargs: dict[str, Any] = {"client_options": options, "retry_config": retry}
        if scheme == "s3" and os.environ.get("AWS_PROFILE") and not os.environ.get("AWS_ACCESS_KEY_ID"):
            kwargs["credential_provider"] = _profile_credentials()
        self._store = self._call(f"{self.url_root}: cannot set up the client", lambda: from_url(self.url_root, **kwargs))
        self._lock = threading.Lock()
        self._listings: dict[str, tuple[dict[str, ObjectInfo], set[str]]] = {}
        self._objects: dict[tuple[str, ObjectInfo], bytes] = {}  # small objects and heads (`_small`)
        self._pool = ThreadPoolExecutor(READS_IN_FLIGHT, thread_name_prefix="hpckpt-get")

    # -- errors --------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except HpckptError:
            raise
        except FileNotFoundError as exc:
            raise MissingFileError(f"{what}: not found", hint=_hint(exc)) from None
        except Exception as exc:  # obstore's errors, connection errors
            raise StorageError(f"{what}: {_one_line(exc)}", hint=_hint(exc)) from None

    # -- listing -------------------------------------------------------------------------------

    def listing(self, key: str) -> tuple[dict[str, ObjectInfo], set[str]]:
        """The objects (name -> size and tag) and sub-prefixes directly under `key/`, listed once."""
        with self._lock:
            cached = self._listings.get(key)
        if cached is not None:
            return cached
        prefix = f"{key}/" if key else None
        result = self._call(f"{self.url_root}/{key}: cannot list",
                            lambda: self._ob.list_with_delimiter(self._store, prefix))
        files = {meta["path"].rpartition("/")[2]: _info(meta) for meta in result["objects"]}
        dirs = {p.rstrip("/").rpartition("/")[2] for p in result["common_prefixes"]}
        with self._lock:
            self._listings[key] = (files, dirs)
        return files, dirs

    def info(self, key: str) -> ObjectInfo | None:
        """The object's size and tag, None when there is none (from the parent's listing if listed,
        else a HEAD)."""
        parent, _, name = key.rpartition("/")
        with self._lock:
            cached = self._listings.get(parent)
        if cached is not None:
            return cached[0].get(name)
        try:
            meta = self._call(f"{self.url_root}/{key}", lambda: self._ob.head(self._store, key))
        except MissingFileError:
            return None
        return _info(meta)

    def is_prefix(self, key: str) -> bool:
        files, dirs = self.listing(key)
        return bool(files or dirs)

    def walk(self, key: str) -> dict[str, int]:
        """Every object under `key/`, at any depth: relative name -> size (not cached)."""
        prefix = f"{key}/" if key else ""
        out: dict[str, int] = {}
        for batch in self._call(f"{self.url_root}/{key}: cannot list",
                                lambda: list(self._ob.list(self._store, prefix or None, chunk_size=1000))):
            for meta in batch:
                out[meta["path"][len(prefix):]] = int(meta["size"])
        return out

    def refresh(self, key: str) -> None:
        """Drop what is cached of `key` and everything under it (other processes write there)."""
        with self._lock:
            inside = lambda k: k == key or not key or k.startswith(f"{key}/")  # noqa: E731
            for cached in [c for c in self._objects if inside(c[0])]:
                del self._objects[cached]
            for listed in [k for k in self._listings if inside(k)]:
                del self._listings[listed]
        self.forget(key)

    def forget(self, key: str) -> None:
        """Drop cached listings that `key` (written or deleted) changes."""
        with self._lock:
            for cached in [c for c in self._objects if c[0] == key]:
                del self._objects[cached]
            parts = key.split("/")
            for i in range(len(parts)):
                self._listings.pop("/".join(parts[:i]), None)

    # -- reads ---------------------------------------------------------------------------------

    def read_into(self, key: str, offset: int, buf: memoryview, info: ObjectInfo) -> int:
        """Fill `buf` from byte `offset` of the object as `info` lists it; returns how many bytes
        there were (fewer at its end). Large reads go out as `READ_PIECE` ranges, several at once.

        Raises:
            CorruptDataError: the object changed since it was listed (its tag no longer matches).
        """
        n = max(0, min(len(buf), info.size - offset))
        if n == 0:
            return 0
        if info.size <= SMALL_OBJECT or offset + n <= HEAD_BYTES:  # metadata, small files, headers: fetched once
            whole = self._small(key, info)
            got = max(0, min(n, len(whole) - offset))
            buf[:got] = whole[offset:offset + got]
            return got
        starts = list(range(offset, offset + n, READ_PIECE))
        pieces = [(s, min(s + READ_PIECE, offset + n)) for s in starts]

        def fetch(piece: tuple[int, int]) -> int:
            data = memoryview(self._get(key, info, piece))
            buf[piece[0] - offset:piece[0] - offset + len(data)] = data
            return len(data)

        if len(pieces) == 1:
            return fetch(pieces[0])
        return sum(self._pool.map(fetch, pieces))

    def _get(self, key: str, info: ObjectInfo, byte_range: tuple[int, int]):
        options: dict[str, Any] = {"range": byte_range}
        if info.etag:
            options["if_match"] = info.etag
        from obstore.exceptions import PreconditionError

        where = f"{self.url_root}/{key}"
        try:
            return self._call(where, lambda: self._ob.get(self._store, key, options=options).bytes())
        except StorageError as exc:
            if isinstance(exc.__context__, PreconditionError):  # (`_call` raised it while handling that)
                raise CorruptDataError(f"{where}: the object changed while it was being read",
                                       hint="another run replaced it: run the command again") from None
            raise

    def _small(self, key: str, info: ObjectInfo) -> bytes:
        with self._lock:
            cached = self._objects.get((key, info))
        if cached is None:
            end = info.size if info.size <= SMALL_OBJECT else min(info.size, HEAD_BYTES)
            cached = bytes(self._get(key, info, (0, end)))
            with self._lock:
                self._objects[(key, info)] = cached
                while len(self._objects) > SMALL_CACHED:
                    self._objects.pop(next(iter(self._objects)))
        return cached

    def read_fresh(self, key: str) -> bytes | None:
        """The object's bytes as they are now (no listing, no cache), None when there is none."""
        try:
            return self.read_all(key)
        except MissingFileError:
            return None

    def read_all(self, key: str) -> bytes:
        return bytes(self._call(f"{self.url_root}/{key}", lambda: self._ob.get(self._store, key).bytes()))

    # -- writes --------------------------------------------------------------------------------

    def upload(self, key: str, source: Path, memory: int = UPLOAD_PART * UPLOAD_CONCURRENCY) -> None:
        """A local file as an object, holding at most `memory` bytes of it at once: up to
        `SINGLE_PUT` bytes in one request, larger files multipart, `memory // UPLOAD_PART` parts
        in flight (at least one)."""
        if Path(source).stat().st_size <= min(SINGLE_PUT, max(memory, UPLOAD_PART)):
            self.put(key, Path(source).read_bytes())
            return
        parts = max(1, memory // UPLOAD_PART - 1)  # (the client reads the next part while these go up)
        self._call(f"{self.url_root}/{key}: cannot write", lambda: self._ob.put(
            self._store, key, Path(source), chunk_size=UPLOAD_PART, max_concurrency=parts))
        self.forget(key)

    @contextmanager
    def writer(self, key: str, memory: int = UPLOAD_PART * UPLOAD_CONCURRENCY):
        """An object written front to back (`write(data)`), multipart, holding at most about
        `memory` bytes: it exists once the block ends; an error inside the block aborts the
        upload, and no object appears."""
        parts = max(1, memory // UPLOAD_PART - 1)  # (besides the part being filled)
        where = f"{self.url_root}/{key}: cannot write"
        handle = self._call(where, lambda: self._ob.open_writer(self._store, key, buffer_size=UPLOAD_PART,
                                                                  max_concurrency=parts))
        try:
            yield lambda data: self._call(where, lambda: handle.write(data))
        except BaseException as exc:
            handle.__exit__(type(exc), exc, exc.__traceback__)  # (obstore aborts a writer left by an error)
            raise
        else:
            self._call(where, handle.close)
        finally:
            self.forget(key)

    def put(self, key: str, data: bytes) -> None:
        """Write a small object in one request."""
        self._call(f"{self.url_root}/{key}: cannot write",
                   lambda: self._ob.put(self._store, key, data, use_multipart=False))
        self.forget(key)

    def create(self, key: str, data: bytes) -> bool:
        """Write a small object only if none exists (a conditional write, `If-None-Match: *`):
        False when one did."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        def attempt() -> bool:
            try:
                self._ob.put(self._store, key, data, mode="create", use_multipart=False)
            except (AlreadyExistsError, PreconditionError):
                return False
            return True

        try:
            return self._call(f"{self.url_root}/{key}: cannot write", attempt)
        finally:
            self.forget(key)

    def delete(self, keys: list[str]) -> None:
        """Delete these objects; one that is not there is fine (S3 says nothing of it, Azure does)."""
        if not keys:
            return

        def attempt() -> None:
            try:
                self._ob.delete(self._store, list(keys))
            except FileNotFoundError:
                for key in keys:  # one at a time then: the others must still go
                    try:
                        self._ob.delete(self._store, key)
                    except FileNotFoundError:
                        pass

        self._call(f"{self.url_root}: cannot delete {len(keys)} object(s)", attempt)
        for key in keys:
            self.forget(key)


def _info(meta: dict) -> ObjectInfo:
    modified = meta.get("last_modified")
    return ObjectInfo(int(meta["size"]), meta.get("e_tag"), modified.timestamp() if modified is not None else 0.0)


def _profile_credentials() -> Any:
    try:
        from obstore.auth.boto3 import Boto3CredentialProvider
        import boto3
    except ImportError:
        raise ExtraNotInstalledError("AWS_PROFILE is set: reading a profile needs boto3, which is not installed",
                                     hint="pip install boto3, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") from None
    try:
        return Boto3CredentialProvider(boto3.Session())
    except Exception as exc:  # botocore's ProfileNotFound and other configuration errors
        raise StorageError(f"AWS_PROFILE={os.environ.get('AWS_PROFILE')!r}: {_one_line(exc)}",
                           hint="check ~/.aws/config and ~/.aws/credentials, or set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY") from None


_CODE = re.compile(r"<Code>([^<]+)</Code>")


def _one_line(exc: BaseException) -> str:
    """The store's answer in one line: its error code if it gave one, else the first line."""
    text = str(exc)
    code = _CODE.search(text)
    kind = type(exc).__name__
    if not code and kind in ("PermissionDeniedError", "UnauthenticatedError"):  # (a HEAD's answer has no body)
        status = re.search(r"status code: (\d{3}[^:]*)", text)
        return ("access denied" if kind == "PermissionDeniedError" else "not authenticated") + (
            f" ({status.group(1).strip()})" if status else "")
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    first = re.sub(r"\s+", " ", first)[:300]
    status = re.search(r"status code: (\d{3}[^:]*)", text)
    if code:
        return f"{code.group(1)}" + (f" ({status.group(1).strip()})" if status else "")
    if "error sending request" in text or "Connection refused" in text or "tcp connect" in text:
        return "the endpoint does not answer (" + first + ")"
    return first


def _hint(exc: BaseException) -> str | None:
    text = str(exc)
    if "NoSuchBucket" in text:
        return "the bucket does not exist: create it, or check the URL and AWS_ENDPOINT_URL"
    if "AccessDenied" in text or "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text or "403" in text:
        return "access denied: check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and the bucket's policy"
    if "error sending request" in text or "Connection refused" in text:
        return "check AWS_ENDPOINT_URL and the network"
    return None


