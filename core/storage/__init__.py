"""Where a checkpoint's bytes live: the local file system or an object store (`s3://`, `gs://`,
`az://`), reached through one small interface (ranged read, whole-object write, list, delete).

Local paths stay `pathlib.Path`; an object is an `ObjectPath` that answers the same questions
(`/`, `name`, `is_file()`, `iterdir()`, `stat()`) from the store's listing, and refuses to be
used as a local path (`os.fspath` raises), so no local file function can touch it by mistake.
The object-store client (obstore) is an optional extra, imported only when a URL is given.
"""
