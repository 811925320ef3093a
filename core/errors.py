"""One error hierarchy; every class carries the exit code the CLI returns for it.

The codes are part of the interface (`EXIT_CODES` below, the table in docs/safety.md): scripts that fan hpckpt out over
many machines branch on them. A lower code is a more fundamental problem; `verify` exits with the
lowest code among its findings.
"""

from __future__ import annotations

from dataclasses import dataclass


class HpckptError(Exception):
    """Base of every error hpckpt raises on purpose; `exit_code` is what the CLI exits with."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class PathNotFoundError(HpckptError, FileNotFoundError):
    """The path given on the command line does not exist."""

    exit_code = 3
    kind = "path-not-found"


class NotACheckpointError(HpckptError):
    """The path exists but holds nothing that looks like a checkpoint."""

    exit_code = 4
    kind = "not-a-checkpoint"


class UnknownFormatError(HpckptError):
    """The path looks like a checkpoint, but of a format or version hpckpt does not read."""

    exit_code = 5
    kind = "unknown-format"


class CorruptMetadataError(HpckptError):
    """A metadata file is truncated, not a pickle, or does not have the structure it must."""

    exit_code = 6
    kind = "corrupt-metadata"


class UnsafePickleError(HpckptError):
    """A pickle names a global outside the allow-list; nothing from it was run."""

    exit_code = 7
    kind = "unsafe-pickle"


class MissingFileError(HpckptError):
    """A data file the metadata refers to does not exist or cannot be read."""

    exit_code = 8
    kind = "missing-file"


class CorruptDataError(HpckptError):
    """A data file is truncated or malformed (safetensors header, zip record, byte range)."""

    exit_code = 9
    kind = "corrupt-data"


class EntryMismatchError(HpckptError):
    """Metadata and data disagree: a tensor key is missing, or its dtype or shape differ."""

    exit_code = 10
    kind = "entry-mismatch"


class GeometryError(HpckptError):
    """Chunk boxes do not fit the tensor: out of bounds, gaps or overlaps."""

    exit_code = 11
    kind = "geometry"


class UnsafePathError(HpckptError):
    """A relative path in the metadata leaves the checkpoint directory."""

    exit_code = 12
    kind = "unsafe-path"


class InterruptedSaveError(HpckptError):
    """Files left by an interrupted save are present."""

    exit_code = 13
    kind = "interrupted-save"


class DestinationExistsError(HpckptError):
    """The destination exists and --force was not given."""

    exit_code = 14
    kind = "destination-exists"


class UnsupportedDTypeError(HpckptError):
    """A tensor's dtype is one the source format cannot be read in, or the target format cannot
    hold (complex in a `.ckpt`, complex128 in safetensors): refused before anything is written."""

    exit_code = 15
    kind = "dtype-not-supported"


class UnsafeDestinationError(HpckptError):
    """The destination is the source, lies inside it or contains it, or `--force` would replace
    something that is neither a checkpoint nor an output of hpckpt (nor an empty directory)."""

    exit_code = 16
    kind = "unsafe-destination"


class DestinationLockedError(HpckptError):
    """Another hpckpt run is writing the same destination (the message names its pid)."""

    exit_code = 17
    kind = "destination-locked"


class NoSpaceError(HpckptError):
    """The destination's file system is full (ENOSPC, or EDQUOT: over quota); nothing is left behind."""

    exit_code = 18
    kind = "no-space"


class WriteFailedError(HpckptError):
    """Writing the destination failed for another reason the system gave (permission denied, a
    read-only file system, an I/O error); nothing is left behind."""

    exit_code = 19
    kind = "write-failed"


class InterruptedRunError(HpckptError):
    """Stopped by a signal: Ctrl-C (SIGINT, exit 130), SIGTERM (143) or SIGHUP (129), the shell's
    128 + signal number; the staging data is removed before exiting."""

    exit_code = 130
    kind = "interrupted"

    def __init__(self, signum: int = 2):
        import signal

        super().__init__(f"interrupted ({signal.Signals(signum).name})")
        self.exit_code = 128 + signum


class RulesFileError(HpckptError, ValueError):
    """Report a wrong rules file (TOML layout or name rules) as a usage error (exit 2).

    A rules file is part of the command line, so a bad one is a bad option value. Being a
    ValueError too, it takes the CLI's `except ValueError -> typer.BadParameter` path wherever a
    command parses its options that way. A rules file that does not exist raises
    `PathNotFoundError` (exit 3) instead.
    """

    exit_code = 2
    kind = "rules-file"


class LayoutRuleError(RulesFileError):
    """Report a wrong layout rules file (`--layout-rules`): bad TOML, unknown keys, bad rules."""

    kind = "layout-rules"


class NameRuleError(RulesFileError):
    """Report a wrong name-rules file or option (`--name-rules`, `--names`): a usage error (exit 2)."""

    kind = "name-rules"


class NameCollisionError(NameRuleError):
    """Two source tensors would be written under one destination name."""

    kind = "name-collision"

    def __init__(self, destination: str, sources: tuple[str, str], rules: tuple[str, str]):
        super().__init__(
            f"{sources[0]!r} ({rules[0]}) and {sources[1]!r} ({rules[1]}) both map to {destination!r}",
            hint="add a rule that renames one of them (first matching rule wins), or --exclude one",
        )
        self.destination = destination
        self.sources = sources



class UsageError(HpckptError, ValueError):
    """A command-line value that names nothing hpckpt can act on (a URL of an unknown scheme, no
    bucket): a usage error, exit 2."""

    exit_code = 2
    kind = "usage"


class ExtraNotInstalledError(HpckptError):
    """A URL was given, but the optional object-store client (`pip install 'hpckpt[s3]'`) is not
    installed; local paths need none of it."""

    exit_code = 26
    kind = "extra-not-installed"


class StorageError(HpckptError):
    """The object store refused or could not be reached: a bucket that does not exist, access
    denied, bad credentials, an endpoint that does not answer, or errors that outlasted the
    retries. Nothing was left that looks like a checkpoint."""

    exit_code = 27
    kind = "storage"


# Errors of the live library (`hpckpt.dist`) and of `hpckpt run`.

class AccountingError(HpckptError):
    """An entry would be lost or changed in kind without being reported: a bug, exit 1."""

    exit_code = 1
    kind = "internal"


class BudgetSettingError(RulesFileError):
    """`HPCKPT_PICKLE_BUDGET` cannot be parsed: a wrong setting is a usage error (exit 2)."""

    kind = "pickle-budget"


class CheckFailedError(HpckptError):
    """A loaded box differs from the checkpoint's bytes."""

    exit_code = 23
    kind = "check-failed"


class CoordinationTimeoutError(HpckptError, TimeoutError):
    """Some ranks of a save did not arrive within the bounded wait (they died, hang, or run
    another sequence of saves)."""

    exit_code = 20
    kind = "coordination-timeout"


class InjectedFailure(HpckptError):
    """`--fail-rank`: the failure a test asks one rank to have, while it writes."""

    exit_code = 1
    kind = "injected-failure"


class JobFailedError(HpckptError):
    """A rank of an `hpckpt run` job failed, or the launcher did (the message names the rank and its log)."""

    exit_code = 22
    kind = "job-failed"


class LauncherNotFoundError(HpckptError):
    """torchrun or msrun is not installed in this environment (nor on PATH)."""

    exit_code = 24
    kind = "launcher-not-found"


class PlacementFitError(HpckptError, ValueError):
    """A placement that fits none of the tensors it applies to: a usage error (exit 2), since the
    option or rules file that gives it says nothing that can be carried out."""

    exit_code = 2
    kind = "usage"


class ReshardOptionError(HpckptError):
    """The options name no valid target (the CLI checks them first; a worker may still meet
    what only the source tells, e.g. --keep-layout of a source without layouts)."""

    exit_code = 2
    kind = "usage"


class SaveError(HpckptError):
    """A rank of the save failed; every rank raises it, and nothing was committed."""

    exit_code = 21
    kind = "save-failed"


class SelftestFailure(HpckptError):
    """The failure `--fail-rank R` asks rank R for: the base error's exit code (1), a kind of its own."""

    kind = "selftest-failure"


SECONDARY_KIND = "worker-failed"  # what the other workers of `run reshard` report: not a root cause of their own


class WorkerFailedError(HpckptError):
    """A worker's failure, raised on every worker with its message and exit code; its kind on the
    failing worker, `worker-failed` on the others (so `hpckpt run` names the failing one)."""

    def __init__(self, worker: int, kind: str, exit_code: int, message: str, hint: str | None = None, *,
                 mine: bool = True):
        super().__init__(f"worker {worker}: {message}", hint=hint)
        self.worker = worker
        self.kind = kind if mine else SECONDARY_KIND
        self.exit_code = exit_code


#: Every error class with an exit code of its own (3 and up), for the documentation table (the
#: exit-code table, one row per kind) and `verify`'s findings. The rules-file errors are left
#: out: they are usage errors, documented there as exit 2 "usage".
ERROR_CLASSES: tuple[type[HpckptError], ...] = (
    PathNotFoundError,
    NotACheckpointError,
    UnknownFormatError,
    CorruptMetadataError,
    UnsafePickleError,
    MissingFileError,
    CorruptDataError,
    EntryMismatchError,
    GeometryError,
    UnsafePathError,
    InterruptedSaveError,
    DestinationExistsError,
    UnsupportedDTypeError,
    UnsafeDestinationError,
    DestinationLockedError,
    NoSpaceError,
    WriteFailedError,
    ExtraNotInstalledError,
    StorageError,
    InterruptedRunError,
)

EXIT_CODE_BY_KIND: dict[str, int] = {cls.kind: cls.exit_code for cls in ERROR_CLASSES}


@dataclass(frozen=True)
class ExitCode:
    """One row of the exit-code table: its code(s), the `kind` every `--json` error document
    names, and what it means."""

    codes: tuple[int, ...]
    kind: str
    meaning: str


#: Every exit code any command returns: the one list. docs/safety.md's table is generated from it
#: (`exit_code_table`), and tests/test_exit_codes.py checks that every code the code can return
#: (each error class's, the CLI's own) is here.
EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode((0,), "", "success; `verify`: no error found; `diff`: the checkpoints are equal within the tolerances"),
    ExitCode((1,), "internal", "a bug in hpckpt (please report it with `hpckpt env` and `--debug` output)"),
    ExitCode((2,), "usage", "bad command-line usage"),
    ExitCode((3,), "path-not-found", "the path does not exist"),
    ExitCode((4,), "not-a-checkpoint",
             "nothing there looks like a checkpoint (data files without metadata: an interrupted save)"),
    ExitCode((5,), "unknown-format", "a checkpoint-like file of a format or dtype hpckpt does not read"),
    ExitCode((6,), "corrupt-metadata", "metadata truncated, not a pickle, or missing required entries"),
    ExitCode((7,), "unsafe-pickle", "a pickle names a global outside the allow-list; nothing from it ran"),
    ExitCode((8,), "missing-file", "a data file named by the metadata is missing or unreadable"),
    ExitCode((9,), "corrupt-data",
             "a data file is truncated or malformed (safetensors header, zip record, byte range), or (`verify "
             "--deep`) its bytes differ from its manifest's digests"),
    ExitCode((10,), "entry-mismatch",
             "a tensor key is missing from its file, or its dtype or shape differ from the metadata"),
    ExitCode((11,), "geometry", "a chunk lies outside its tensor, or chunks leave gaps or overlap"),
    ExitCode((12,), "unsafe-path",
             "a relative path in the metadata leaves the checkpoint directory (other than into a checkpoint beside"
             " it, which HyperParallel's incremental saves point into)"),
    ExitCode((13,), "interrupted-save", "files of a save that did not finish are present"),
    ExitCode((14,), "destination-exists", "the destination exists (commands that write; `--force` overrides)"),
    ExitCode((15,), "dtype-not-supported",
             "a tensor's dtype cannot be held by the target format (or read from the source); nothing was written"),
    ExitCode((16,), "unsafe-destination",
             "the destination is the source, lies inside it or contains it (`--force` or not), or `--force` would "
             "replace something that is neither a checkpoint nor an hpckpt output nor an empty directory"),
    ExitCode((17,), "destination-locked",
             "another hpckpt run is writing the same destination (the message names its pid)"),
    ExitCode((18,), "no-space",
             "the destination's disk is full or over quota (for an object store: its local spool, "
             "`HPCKPT_SPOOL_DIR`), checked before writing and during it; nothing was left behind"),
    ExitCode((19,), "write-failed",
             "the system refused another write (permission denied, read-only file system, I/O error); nothing was "
             "left behind"),
    ExitCode((20,), "coordination-timeout",
             "`hpckpt.dist`: some ranks of a storage-coordinated save did not arrive within the wait (the message "
             "names them); nothing was committed"),
    ExitCode((21,), "save-failed",
             "`hpckpt.dist`: another rank of the save failed (named in the message); nothing was committed"),
    ExitCode((22,), "job-failed",
             "`hpckpt run`: a rank of the launched job failed; the message names the rank, its error line and its "
             "log"),
    ExitCode((23,), "check-failed",
             "`hpckpt run load --check`: a loaded box or value differs from an independent read of the checkpoint"),
    ExitCode((24,), "launcher-not-found",
             "`hpckpt run`: torchrun or msrun is not installed in this environment (nor on PATH)"),
    ExitCode((25,), "differ", "`diff`: the checkpoints differ beyond the tolerances (the report says where)"),
    ExitCode((26,), "extra-not-installed",
             "a URL (`s3://`, `gs://`, `az://`) was given, but the object-store client is not installed: `pip "
             "install 'hpckpt[s3]'`"),
    ExitCode((27,), "storage",
             "the object store refused or did not answer: no such bucket, access denied, bad credentials, an "
             "endpoint that does not answer, errors that outlasted the retries; nothing was left that looks like a"
             " checkpoint"),
    ExitCode((129, 130, 143), "interrupted",
             "SIGHUP, Ctrl-C (SIGINT), SIGTERM (128 + the signal's number, as the shell reports it); the staging "
             "data is removed first"),
)


def exit_code_table() -> str:
    """EXIT_CODES as the Markdown table the docs carry."""
    rows = ["| code | kind | meaning |", "|---|---|---|"]
    rows += [f"| {', '.join(map(str, e.codes))} | {e.kind} | {e.meaning} |" for e in EXIT_CODES]
    return "\n".join(rows) + "\n"
