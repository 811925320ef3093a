"""What may be written where: a destination never overlaps its source or a staging name, an
existing one is replaced only with `--force` and only when hpckpt recognises it (a checkpoint
holding nothing else, an hpckpt output, an empty directory), a fan-out share goes only into a new,
empty or in-progress directory, and missing parents are created only with `--parents`.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpckpt.core.commit import formats
from hpckpt.core.commit.leftovers import (
    FRAGMENT_DIR,
    STAGING_NAME,
    TMP_MARK,
    sidecar_owner_path,
    sidecars_of,
    staging_directory,
)
from hpckpt.core.commit.lock import LOCK_SUFFIX
from hpckpt.core.commit.manifest import SUFFIX as MANIFEST_SUFFIX
from hpckpt.core.errors import (
    CorruptMetadataError,
    DestinationExistsError,
    HpckptError,
    PathNotFoundError,
    UnsafeDestinationError,
)
from hpckpt.core.storage.object_path import is_object


# -- what may be written where ----------------------------------------------------------------


def refuse_unsafe(dest: Path, source: Path | None) -> None:
    """A destination that is the source, lies inside it or contains it is refused, `--force` or
    not: writing it would change or delete the checkpoint being read (real paths compared).

    Raises:
        UnsafeDestinationError: it is.
    """
    if source is None:
        return
    hint = "write the output somewhere else"
    if is_object(dest) or is_object(source):
        _refuse_object_overlap(dest, source, hint)
        return
    src, out = Path(os.path.realpath(source)), Path(os.path.realpath(dest))
    if out == src:
        raise UnsafeDestinationError(f"{dest} is the source {source}", hint=hint)
    if src.is_dir() and out.is_relative_to(src):
        raise UnsafeDestinationError(f"{dest} lies inside the source {source}: writing there would change the "
                                     "checkpoint being read", hint=hint)
    if src.is_relative_to(out):
        raise UnsafeDestinationError(f"{dest} contains the source {source}: replacing it would delete the "
                                     "checkpoint being read", hint=hint)


def _refuse_object_overlap(dest, source, hint: str) -> None:
    """`refuse_unsafe` where either is an object: only objects of the same store can overlap, and
    keys compare as paths do (a store has no links)."""
    if not (is_object(dest) and is_object(source)) or source.store is not dest.store:
        return
    if dest.key == source.key:
        raise UnsafeDestinationError(f"{dest} is the source {source}", hint=hint)
    if dest.is_relative_to(source) and source.is_dir():
        raise UnsafeDestinationError(f"{dest} lies inside the source {source}", hint=hint)
    if source.is_relative_to(dest):
        raise UnsafeDestinationError(f"{dest} contains the source {source}", hint=hint)


def refuse_staging_name(dest: Path) -> None:
    """A destination that is (or lies in) an hpckpt staging name is refused: `verify` would never
    accept it and the next run for its destination would remove it.

    Raises:
        UnsafeDestinationError: it is.
    """
    staging = staging_directory(Path(dest).absolute())
    if staging is not None:
        where = "is" if staging == Path(dest).absolute() else f"lies in {staging}, which is"
        raise UnsafeDestinationError(f"{dest} {where} an hpckpt staging name (`.NAME{TMP_MARK}PID`): what is written "
                                     "there is never read as a checkpoint and is removed by a later run",
                                     hint="choose a name without `.hpckpt-tmp-`")


def refuse_not_fan_out(dest: Path) -> None:
    """Fan-out jobs write into a new or empty directory, or one their own jobs began (it holds
    `.hpckpt-fanout/`); never into any other existing file or directory, whose files a job's
    would replace.

    Raises:
        DestinationExistsError: it is something else.
    """
    if not os.path.lexists(dest):
        return
    hint = ("fan-out jobs write into a new or empty directory, or one that jobs of the same reshard began: "
            "choose another destination, or remove it yourself")
    if not dest.is_dir():
        raise DestinationExistsError(f"{dest} exists and is not a directory", hint=hint)
    names = os.listdir(dest)
    if names and FRAGMENT_DIR not in names and recognised(dest):
        raise DestinationExistsError(f"{dest} is already a finished checkpoint", hint=hint)
    if names and FRAGMENT_DIR not in names:
        raise DestinationExistsError(f"{dest} exists and is not a fan-out in progress (it holds {len(names)} "
                                     f"{'entry' if len(names) == 1 else 'entries'} and no {FRAGMENT_DIR}/)",
                                     hint=hint)


def refuse_existing(dest: Path, force: bool, file_output: bool = False) -> None:
    """Every writing command leaves an existing destination alone unless told to replace it, and
    with `force` replaces only what hpckpt recognises (`_foreign`).

    Raises:
        DestinationExistsError: it exists and `force` is off, or a single-file output would
            replace a directory.
        UnsafeDestinationError: `force` is on and it is not something hpckpt may replace.
    """
    if is_object(dest):  # (with `force`, the commit checks what it replaces: core.commit.object_staging)
        if not force and (dest.is_file() if file_output else dest.is_dir()):
            raise DestinationExistsError(f"{dest} exists", hint="pass --force to replace it")
        return
    if not os.path.lexists(dest):
        return
    if not force:
        raise DestinationExistsError(f"{dest} exists", hint="pass --force to replace it")
    if file_output and dest.is_dir():  # --force replaces a file with a file, never a directory
        raise DestinationExistsError(f"{dest} is a directory; a single-file output cannot replace it",
                                     hint="name a file (model.safetensors, model.pt, model.ckpt), or remove "
                                          "the directory yourself")
    _refuse_foreign(dest)


def refuse_existing_sidecars(dest: Path, staged: list[str], force: bool) -> None:
    """A sidecar already beside a single-file destination is part of what would be replaced; one
    hpckpt wrote whose file is gone describes nothing any more, and is replaced without --force."""
    orphaned = not os.path.lexists(dest)
    for name in dict.fromkeys((*sidecars_of(dest.name), *staged)):
        path = dest.parent / name
        if os.path.lexists(path) and name != dest.name:
            if orphaned and _foreign(path) is None:
                continue
            if not force:
                raise DestinationExistsError(f"{path} exists", hint="pass --force to replace it")
            _refuse_foreign(path)


def _refuse_foreign(path: Path) -> None:
    what = _foreign(path)
    if what is not None:
        raise UnsafeDestinationError(f"refusing to replace {path}: {what}",
                                     hint="--force replaces only checkpoints and hpckpt's own outputs: remove it "
                                          "yourself, or choose another destination")


def _foreign(path: Path) -> str | None:
    """Why `path` is not something `--force` may replace, or None: a checkpoint or file hpckpt
    reads, a values sidecar, what an hpckpt run left, or an empty directory."""
    if staging_directory(path.absolute()) is not None:
        return None
    if path.is_dir():
        names = os.listdir(path)
        if not names or FRAGMENT_DIR in names:
            return None
        if not recognised(path):
            return f"it holds {len(names)} {'entry' if len(names) == 1 else 'entries'} and no checkpoint"
        return _unaccounted(path, names)
    if path.is_file():
        if path.name.endswith(MANIFEST_SUFFIX):
            return None if _is_manifest(path) else "it is not a manifest hpckpt wrote"
        if sidecar_owner_path(path) is not None:
            return None if _is_sidecar(path) else "it is not a values sidecar hpckpt wrote"
        return None if recognised(path) else (f"it is a file of {path.stat().st_size} bytes and no checkpoint "
                                               "hpckpt recognises")
    return "it is neither a regular file nor a directory"


def _is_manifest(path: Path) -> bool:
    from hpckpt.core.commit import manifest

    try:
        return manifest.read(path) is not None
    except (HpckptError, OSError):
        return False


def _unaccounted(path: Path, names: list[str]) -> str | None:
    """Why the checkpoint directory `path` may not be replaced whole, or None: its metadata cannot
    be read, or it holds entries (`names`, its top level) that are neither the files its
    metadata refers to nor hpckpt's own (the manifest, `.hpckpt.json`, locks, staging names, sidecars)."""
    try:
        index = formats.known().open_index(path)
    except (HpckptError, OSError) as exc:
        return f"its metadata cannot be read ({getattr(exc, 'message', exc)}), so what it holds is unknown"
    own = {Path(name).parts[0] for name in (*index.data_files, *index.metadata_files) if Path(name).parts}
    strays = sorted(name for name in names if name not in own and not _hpckpt_own(path, name, own, index.format))
    if not strays:
        return None
    shown = ", ".join(strays[:3]) + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
    return f"{shown} {'is' if len(strays) == 1 else 'are'} not part of its checkpoint"


def _hpckpt_own(directory: Path, name: str, listed: set[str], fmt: str) -> bool:
    """A top-level entry of a checkpoint directory that hpckpt itself writes or leaves there."""
    from hpckpt.core.commit import manifest

    knowledge = formats.known()
    if name in (manifest.NAME, FRAGMENT_DIR) or STAGING_NAME.match(name) or knowledge.is_own_file(name, fmt):
        return True
    if name.endswith(manifest.SUFFIX) and name.removesuffix(manifest.SUFFIX) in listed:  # a file's manifest
        return True
    if name.startswith(".") and name.endswith(LOCK_SUFFIX):
        return True
    if knowledge.sidecar_owner(name) in listed:  # values sidecars, a file's manifest
        return True
    cache = knowledge.cache_dir()  # the index cache, when HPCKPT_CACHE_DIR puts it there
    try:
        return cache is not None and Path(os.path.realpath(cache)).is_relative_to(os.path.realpath(directory / name))
    except OSError:
        return False


def recognised(path: Path) -> bool:
    """`path` is a checkpoint of a format hpckpt reads (a broken one too)."""
    try:
        formats.known().detect(path)
    except CorruptMetadataError:
        return True  # a checkpoint of a format hpckpt reads, broken
    except HpckptError:
        return False
    return True


def _is_sidecar(path: Path) -> bool:
    try:
        formats.known().read_sidecar(path)
    except HpckptError:
        return False
    return True


def ensure_parent(dest: Path, parents: bool) -> list[Path]:
    """The directory the destination goes in exists, or is created when `parents` says so.
    Returns the directories created, the deepest first (what `remove_made` takes back after a
    failure, so that a failed run leaves nothing, parents included).

    Raises:
        PathNotFoundError: it is missing (and `parents` is off), or a file is in the way.
    """
    parent = dest.parent
    if parent.is_dir():
        return []
    existing = parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PathNotFoundError(f"cannot write {dest}: {existing} is not a directory")
    if not parents:
        raise PathNotFoundError(f"{parent}: no such directory (the destination's parent)",
                                hint="create it, or pass --parents to have it created")
    missing = [parent, *parent.parents[:len(parent.parents) - len(existing.parents) - 1]]
    parent.mkdir(parents=True, exist_ok=True)
    return missing


def remove_made(directories: list[Path]) -> None:
    """Remove the directories `ensure_parent` made, deepest first, those still empty only (another
    run may have put something in one since)."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return
