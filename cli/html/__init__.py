"""Self-contained HTML pages (`--html FILE`): one file with its styles, script and data inline, so
it opens from a laptop's disk or a cluster's shared drive with no network access at all (no CDN,
no font, no request of any kind). The data travels as JSON in a `<script type="application/json">`
element; large numeric columns as deflate-compressed base64, which the browser's own
`DecompressionStream` expands."""

from __future__ import annotations

import base64
import json
import zlib
from importlib import resources
from pathlib import Path

import numpy as np


def column(values: np.ndarray) -> str:
    """A numeric column as the page reads it: little-endian bytes, deflated, base64."""
    raw = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def map_document(data: dict, label: str | None = None) -> dict:
    """A shard map (`api.shard_map`) as the page reads it: its numeric columns compressed."""
    return {"label": label, "tensors": data["tensors"], "problems": data["problems"],
            "rank_bytes": data["rank_bytes"], "unranked_bytes": data["unranked_bytes"],
            "columns": {k: column(data[k]) for k in ("offsets", "sizes", "ranks")}}


def _inline_json(document: dict) -> str:
    """JSON safe inside a `<script>` element: no `</` can end it early, and no line separator
    characters that older parsers take for line ends."""
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False)
    return text.replace("</", "<\\/").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def page(title: str, script: str, document: dict) -> str:
    """The whole page: `script` (a file of this package, after `common.js`) draws it from `document`."""
    from html import escape

    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; connect-src data: blob:\">"
            f"<title>{escape(title)}</title><style>{_asset('page.css')}</style></head>\n<body>\n"
            f"<script id=\"data\" type=\"application/json\">{_inline_json(document)}</script>\n"
            f"<script>{_asset('common.js')}\n{_asset(script)}</script>\n</body></html>\n")


def write_plan_page(path: Path, src, dst, source_format: str, target_format: str, view: dict,
                    prediction: dict | None = None) -> int:
    """A plan's page (`api.plan_view`'s `view`): both shard maps and the target ranks' shares."""
    world = len(view["target"]["rank_bytes"])
    written = sum(r[1] for r in view["ranks"])
    meta = {"title": f"{src} -> {dst}: plan",
            "facts": [f"{source_format} -> {target_format}", f"{world} target rank{'s' if world != 1 else ''}",
                      f"writes {written:,} B of tensors"], "selected": ""}
    document = {"kind": "plan", "meta": meta,
                "maps": [map_document(view["source"], f"source ({source_format})"),
                         map_document(view["target"], f"target ({target_format}, {world} rank{'s' if world != 1 else ''})")],
                "plan": {"ranks": view["ranks"], "files": view["files"], "touched": column(view["touched"]),
                         "touched_start": column(view["touched_start"]), "prediction": prediction}}
    return write_page(path, meta["title"], "shard_map.js", document)


def write_page(path: Path, title: str, script: str, document: dict) -> int:
    """Write the page to `path` whole (a temporary name, then a rename); returns its size.

    Raises:
        WriteFailedError, NoSpaceError: it cannot be written there (nothing is left behind).
    """
    from hpckpt.core.commit.durable import write_error
    from hpckpt.core.commit.replace import replace_file

    data = page(title, script, document).encode("utf-8")
    try:
        replace_file(Path(path), data, fsync=False)
    except OSError as exc:
        raise write_error(exc, Path(path), len(data)) from None
    return len(data)
