"""`inspect --html` and `inspect --map`, seen as a person sees them: each page is opened in a real
headless Chromium (`browser.py`), its DOM checked for the boxes, ranks, gaps, overlaps and bytes
the checkpoint holds, its screenshot checked not to be blank, and every request it might make
sent to a counting proxy (it makes none). Checkpoints come from the independent writer in
`hp_reference` and from HyperParallel's own rank-local save (replicas)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
from _util import FIXTURES
from browser import BROWSER_SERVICES, CountingProxy, colours, render
from hp_reference import dump_hp, write_hp
from typer.testing import CliRunner

from hpckpt.cli.app import app

runner = CliRunner()
HOSTILE = '<img src=x onerror="document.body.dataset.pwned=1">'


def hpckpt(*args, code: int = 0) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def checkpoint(root: Path) -> Path:
    """w split by rows over 4 ranks; `gappy` missing row 2; `over` with rows 2 stored twice; a
    tensor whose name is markup."""
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    m = np.ones((4, 4), np.float32)
    return write_hp(root, {
        "w": ("torch.float32", (8, 4), [(f"_rank{r}_.safetensors", "w", (2 * r, 0), w[2 * r:2 * r + 2]) for r in range(4)]),
        "gappy": ("torch.float32", (4, 4), [("_rank0_.safetensors", "gappy", (0, 0), m[:2]),
                                             ("_rank1_.safetensors", "gappy", (3, 0), m[3:])]),
        "over": ("torch.float32", (4, 4), [("_rank2_.safetensors", "over", (0, 0), m[:3]),
                                            ("_rank3_.safetensors", "over", (2, 0), m[2:])]),
        HOSTILE: ("torch.float32", (4,), [("_rank0_.safetensors", "h", (0,), np.zeros(4, np.float32))]),
    })


def rects(dom: str, cls: str) -> list[dict[str, str]]:
    """The attributes of the SVG rects of class `cls` in a dumped DOM."""
    found = []
    for tag in re.findall(r"<rect [^>]*>", dom):
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', tag))
        if cls in attrs.get("class", "").split():
            found.append(attrs)
    return found


def test_the_shard_map_page_in_a_browser(tmp_path):
    root = checkpoint(tmp_path / "ck")
    page = tmp_path / "map.html"
    doc = json.loads(hpckpt("inspect", root, "--html", page, "--json"))
    assert doc["html"] == {"path": str(page), "bytes": page.stat().st_size}
    text = page.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # nothing to load from anywhere
    profile = tmp_path / "profile"
    # w: four boxes, one per rank, and the bytes each rank stores
    dom = render(f"{page.as_uri()}#t=w", profile=profile, screenshot=tmp_path / "w.png", size="1000,700")
    assert 'data-ready="true"' in dom and "data-error" not in dom, dom[-2000:]
    boxes = rects(dom, "box")
    assert sorted((b["data-region"], b["data-ranks"]) for b in boxes) == [
        (f"[{2 * r}:{2 * r + 2}, 0:4]", str(r)) for r in range(4)]
    bars = rects(dom, "rank-bar")
    assert [int(b["data-rank"]) for b in bars] == [0, 1, 2, 3]
    per_rank = {0: 32 + 32 + 16, 1: 32 + 16, 2: 32 + 48, 3: 32 + 32}  # w + gappy + over + the hostile name's
    assert {int(b["data-rank"]): int(b["data-bytes"]) for b in bars} == per_rank
    # the hostile name is text in the list, never markup that runs
    assert "data-pwned" not in dom and "<img" not in dom.split("</script>")[-1]
    assert "&lt;img src=x onerror=" in dom
    # gaps hatched and overlaps framed, where they are
    dom = render(f"{page.as_uri()}#t=gappy", profile=profile)
    assert [g["data-region"] for g in rects(dom, "gap")] == ["[2:3, 0:4]"]
    dom = render(f"{page.as_uri()}#t=over", profile=profile)
    assert [g["data-region"] for g in rects(dom, "overlap")] == ["[2:3, 0:4]"]
    # the screenshot shows the map: many colours, mostly not the page's background
    seen = colours(tmp_path / "w.png")
    background = max(seen.values())
    assert len(seen) > 8 and sum(seen.values()) - background > 0.2 * sum(seen.values()), sorted(seen.values())[-5:]
    # no request of the page's own: every request goes to a counting proxy on 127.0.0.1; the page
    # adds no host to those the browser asks for itself (on a blank page, and its services), where a
    # page that loads an image does
    proxy = CountingProxy()
    try:
        render("about:blank", profile=tmp_path / "p1", proxy=proxy)
        browser_own = proxy.hosts() | BROWSER_SERVICES
        control = tmp_path / "control.html"
        control.write_text('<!doctype html><img src="http://hpckpt-test.invalid/x.png">')
        proxy.requests.clear()
        render(control.as_uri(), profile=tmp_path / "p2", proxy=proxy)
        assert "hpckpt-test.invalid" in proxy.hosts(), proxy.requests
        proxy.requests.clear()
        render(f"{page.as_uri()}#t=w", profile=tmp_path / "p3", proxy=proxy)
        assert proxy.hosts() <= browser_own, proxy.requests
    finally:
        proxy.close()


def test_replicas_are_one_box_of_several_ranks(tmp_path):
    """HyperParallel's rank-local save keeps every rank's copy of a replicated box: one box drawn,
    its ranks listed."""
    source = FIXTURES / "m0-torch-4rank-rankLocal"
    from hpckpt.converters import open_index

    index = open_index(source)
    name, expected = next((n, e) for n, e in index.tensors.items()
                          if len({c.box for c in e.chunks}) < len(e.chunks))
    page = tmp_path / "map.html"
    hpckpt("inspect", source, "--html", page)
    dom = render(f"{page.as_uri()}#t={name}", profile=tmp_path / "profile")
    drawn = {b["data-region"]: b["data-ranks"] for b in rects(dom, "box")}
    holders: dict[str, list[int]] = {}
    for chunk in expected.chunks:
        region = "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(chunk.box.offsets, chunk.box.sizes)) + "]"
        holders.setdefault(region, []).append(int(re.search(r"_rank(\d+)_", chunk.file).group(1)))
    assert {k: sorted(map(int, v.split(","))) for k, v in drawn.items()} == {k: sorted(v) for k, v in holders.items()}
    assert any("," in v for v in drawn.values())
    assert any("replicated" in b["class"] for b in rects(dom, "box"))


def test_a_thousand_rank_page_stays_small_and_renders_fast(tmp_path):
    """1,024 ranks x 200 tensors (204,800 chunks) of metadata alone: the page is a few MB and
    draws in well under 2 s (the bench measures the 1,000-tensor case)."""
    from hp_reference import ChunkStorageMetadata, Metadata, MetadataIndex, StorageInfo, TensorProperties, \
        TensorStorageMetadata

    ranks, root = 1024, tmp_path / "big"
    root.mkdir()
    state, storage = {}, {}
    for t in range(200):
        fqn = f"layers.{t}.weight"
        state[fqn] = TensorStorageMetadata(TensorProperties("torch.bfloat16"), (ranks * 4, 256),
                                           [ChunkStorageMetadata((4 * r, 0), (4, 256)) for r in range(ranks)])
        for r in range(ranks):
            storage[MetadataIndex(fqn, (4 * r, 0), r)] = StorageInfo(f"_rank{r}_.safetensors", 0, 2048, fqn)
    (root / ".metadata").write_bytes(dump_hp(Metadata(state, {k: (k,) for k in state}, storage)))
    page = tmp_path / "big.html"
    hpckpt("inspect", root, "--html", page, "--summary")
    assert page.stat().st_size < 10 * 2**20, page.stat().st_size
    dom = render(f"{page.as_uri()}#t=layers.7.weight", profile=tmp_path / "profile")
    assert 'data-ready="true"' in dom
    assert int(re.search(r'data-render-ms="(\d+)"', dom).group(1)) < 2000
    assert len(rects(dom, "box")) == ranks and len(rects(dom, "rank-bar")) == ranks


def test_the_map_in_the_terminal(tmp_path):
    root = checkpoint(tmp_path / "ck")
    out = hpckpt("inspect", root, "--map", "gappy", "--map", "over")
    assert "gappy  float32 [4, 4]" in out and "over  float32 [4, 4]" in out
    assert " ." in out and "##" in out and "no chunk covers it" in out
    assert "rank 0" in out and "rank 3" in out
    out = hpckpt("inspect", root, "--map", "w")
    lines = out[out.index("w  float32 [8, 4]"):].splitlines()
    assert len(lines[1:9]) == 8 and "no chunk covers" not in out  # 8 rows, every cell covered
    assert "no tensor matches nothing*" in hpckpt("inspect", root, "--map", "nothing*")


def test_the_plan_page_shows_both_layouts_and_what_each_target_rank_reads(tmp_path):
    """`reshard --plan --html`: the source's and the target's boxes side by side, and per target
    rank the bytes it writes and reads and the source files it opens (those the plan says)."""
    root = checkpoint(tmp_path / "ck")
    page = tmp_path / "plan.html"
    doc = json.loads(hpckpt("reshard", root, "-o", tmp_path / "out", "--world-size", "2", "--plan", "--html", page,
                            "--exclude", "gappy", "--json"))  # (a gap cannot be planned from)
    assert doc["html"]["bytes"] == page.stat().st_size and not (tmp_path / "out").exists()
    dom = render(f"{page.as_uri()}#t=w", profile=tmp_path / "profile")
    assert 'data-ready="true"' in dom
    source = re.search(r'data-map="source[^"]*"(.*?)</svg>', dom, re.S).group(1)
    target = re.search(r'data-map="target[^"]*"(.*?)</svg>', dom, re.S).group(1)
    assert sorted(b["data-region"] for b in rects(source, "box")) == [f"[{2 * r}:{2 * r + 2}, 0:4]" for r in range(4)]
    assert sorted((b["data-region"], b["data-ranks"]) for b in rects(target, "box")) == [
        ("[0:4, 0:4]", "0"), ("[4:8, 0:4]", "1")]
    bars = {(b["data-rank"], b["class"].split()[-1]): b for b in rects(dom, "plan-bar")}
    ranks = {r["rank"]: r for r in doc["plan"]["ranks"]}
    for rank, figures in ranks.items():
        written = bars[(str(rank), "written")]
        assert int(written["data-written"]) == figures["bytes_written"]
        assert int(written["data-read"]) == figures["bytes_read"]
        assert int(written["data-files"]) == figures["source_files"]
    assert f"read amplification {doc['plan']['bytes_read'] / doc['plan']['bytes']:.2f}" in dom
    out = hpckpt("reshard", root, "-o", tmp_path / "out", "--world-size", "2", "--html", page, code=2)
    assert "--html goes with --plan" in out


def test_the_diff_page_shows_where_two_checkpoints_differ(tmp_path):
    """`diff --html`: each differing tensor as blocks coloured by error, with the numbers; the
    blocks hold exactly the elements the diff counted outside the tolerances."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal((64, 48)).astype(np.float32), "same": np.arange(6, dtype=np.int64)}
    b = {k: v.copy() for k, v in a.items()}
    b["w"][10:20, 5:9] += 0.5  # 40 elements outside atol
    b["w"][40, 40] += 1e-4  # inside it
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    page = tmp_path / "diff.html"
    result = runner.invoke(app, ["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--atol",
                                 "1e-3", "--html", str(page), "--json"])
    assert result.exit_code == 25, result.output
    doc = json.loads(result.stdout)
    assert doc["html"]["bytes"] == page.stat().st_size
    dom = render(page.as_uri(), profile=tmp_path / "profile", screenshot=tmp_path / "diff.png", size="1000,700")
    assert 'data-ready="true"' in dom and 'data-tensor="w"' in dom  # opens on the first tensor that differs
    cells = rects(dom, "cell")
    assert len(cells) == 32 * 32
    outside = [c for c in cells if int(c["data-differing"])]
    assert sum(int(c["data-differing"]) for c in cells) == 40
    assert all(abs(float(c["data-max-abs"]) - 0.5) < 1e-6 for c in outside)  # (+0.5 in float32)
    rows = {int(c["data-row"]) for c in outside}
    assert rows == {5, 6, 7, 8, 9}  # rows 10:20 of 64, two a block
    within = [c for c in cells if float(c["data-max-abs"]) > 0 and not int(c["data-differing"])]
    assert len(within) == 1 and int(within[0]["data-row"]) == 20  # row 40: inside the tolerance
    dom = render(f"{page.as_uri()}#t=same", profile=tmp_path / "profile")
    assert "every byte equal (identical)" in dom and not rects(dom, "cell")
    seen = colours(tmp_path / "diff.png")
    assert len(seen) > 4


def test_the_plan_predicts_its_time_from_measured_or_given_bandwidth(tmp_path, monkeypatch):
    """`--plan` times every target rank and the run from the bytes it moves: with `--bandwidth`
    exactly the arithmetic; without, from probes of the two file systems, cached per file system
    (the second plan and the real run reuse them); the real run shows predicted beside measured."""
    from safetensors.numpy import save_file

    monkeypatch.setenv("HPCKPT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model.safetensors"
    save_file({"w": np.random.default_rng(1).standard_normal((1024, 512)).astype(np.float32)}, str(src))  # 2 MiB
    out = tmp_path / "out"
    doc = json.loads(hpckpt("reshard", src, "-o", out, "--world-size", "4", "--plan", "--bandwidth", "1MiB,512KiB",
                            "--json"))
    p = doc["prediction"]
    reads = sum(r["bytes_read"] for r in doc["plan"]["ranks"])
    writes = sum(r["bytes_written"] for r in doc["plan"]["ranks"])
    assert p["seconds"] == round(reads / 2**20 + writes / 2**19, 4) and (p["read_from"], p["write_from"]) == ("option",) * 2
    assert [r["seconds"] for r in p["ranks"]] == [round(r["bytes_read"] / 2**20 + r["bytes_written"] / 2**19, 4)
                                                  for r in doc["plan"]["ranks"]]
    first = json.loads(hpckpt("reshard", src, "-o", out, "--world-size", "4", "--plan", "--json"))["prediction"]
    assert (first["read_from"], first["write_from"]) == ("probe", "probe") and first["seconds"] > 0
    assert first["write_seconds_per_file"] >= 0  # the probe's two sizes separate a fixed cost from the rate
    cache = json.loads((tmp_path / "cache" / "bandwidth.json").read_text())
    assert sorted(k.split(":")[1] for k in cache) == ["read", "write"] and all("per_file_s" in v for v in cache.values())
    assert not [p for p in tmp_path.iterdir() if "-probe" in p.name]  # the probe's file is gone
    again = json.loads(hpckpt("reshard", src, "-o", out, "--world-size", "4", "--plan", "--json"))["prediction"]
    assert (again["read_from"], again["write_from"]) == ("cache", "cache") and again["seconds"] == first["seconds"]
    done = json.loads(hpckpt("reshard", src, "-o", out, "--world-size", "4", "--json"))
    assert done["prediction"]["seconds"] == first["seconds"] and done["prediction"]["measured_seconds"] > 0
    assert "predicted" in hpckpt("reshard", src, "-o", tmp_path / "out2", "--world-size", "4")
    # the plan's page says it too
    page = tmp_path / "plan.html"
    hpckpt("reshard", src, "-o", tmp_path / "out3", "--world-size", "4", "--plan", "--html", page,
           "--bandwidth", "1MiB,512KiB")
    dom = render(page.as_uri(), profile=tmp_path / "profile")
    assert f"predicted {p['seconds']:.2f} s" in dom
    bars = rects(dom, "plan-bar")
    assert sorted({float(b["data-predicted-s"]) for b in bars}) == sorted({r["seconds"] for r in p["ranks"]})
    assert "--bandwidth" in hpckpt("reshard", src, "-o", out, "--world-size", "4", "--plan", "--bandwidth", "fast",
                                   code=2)


def test_a_read_probe_of_a_small_source_still_times_it(tmp_path):
    """A source that reads whole in far less than a timer can tell (here 64 KiB) is read again until
    the probe has run `MIN_PROBE_SECONDS`: a small checkpoint on a fast machine still gets a
    prediction (CI once read 2 MiB too fast and the plan had none). Nothing at all: no figure."""
    from hpckpt.core.io import bandwidth

    small = tmp_path / "small.bin"
    small.write_bytes(np.random.default_rng(0).bytes(64 * 1024))
    started = time.perf_counter()
    speed = bandwidth.probe_read([small], limit=1 << 40)  # (no limit: a fast machine reads 128 MiB in 19 ms)
    assert speed is not None and speed.bytes_per_s > 0
    assert time.perf_counter() - started >= bandwidth.MIN_PROBE_SECONDS
    (tmp_path / "empty.bin").write_bytes(b"")
    assert bandwidth.probe_read([tmp_path / "empty.bin", tmp_path / "missing.bin"]) is None


def test_a_convert_dry_run_page_draws_the_renamed_target(tmp_path):
    """`convert --dry-run --html`: the target map holds the names the rules give, whole tensors
    for a one-file format; without --dry-run, --html is a usage error."""
    root = checkpoint(tmp_path / "ck")
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nmatch = "w"\nrename = "weight"\n')
    page = tmp_path / "convert.html"
    hpckpt("convert", root, "-o", tmp_path / "m.safetensors", "--names", rules, "--exclude", "gappy", "--dry-run",
           "--html", page)
    assert not (tmp_path / "m.safetensors").exists()
    dom = render(f"{page.as_uri()}#t=weight", profile=tmp_path / "profile")  # (both maps name it as written)
    target = re.search(r'data-map="target[^"]*"(.*?)</svg>', dom, re.S).group(1)
    assert 'data-tensor="weight"' in target
    assert [(b["data-region"], b["data-ranks"]) for b in rects(target, "box")] == [("[0:8, 0:4]", "0")]
    out = hpckpt("convert", root, "-o", tmp_path / "m.safetensors", "--html", page, code=2)
    assert "--html goes with --dry-run" in out


def test_a_consolidate_dry_run_page_draws_whole_tensors(tmp_path):
    root = checkpoint(tmp_path / "ck")
    page = tmp_path / "consolidate.html"
    out = hpckpt("consolidate", root, "-o", tmp_path / "m.safetensors", "--exclude", "gappy", "--dry-run", "--html",
                 page)
    assert "nothing written" in out and not (tmp_path / "m.safetensors").exists()
    dom = render(f"{page.as_uri()}#t=w", profile=tmp_path / "profile")
    target = re.search(r'data-map="target[^"]*"(.*?)</svg>', dom, re.S).group(1)
    assert [(b["data-region"], b["data-ranks"]) for b in rects(target, "box")] == [("[0:8, 0:4]", "0")]
    assert "--html goes with --dry-run" in hpckpt("consolidate", root, "-o", tmp_path / "m.safetensors", "--html",
                                                  page, code=2)


def test_a_page_that_cannot_be_written_is_one_line_and_exit_19(tmp_path):
    root = checkpoint(tmp_path / "ck")
    result = runner.invoke(app, ["inspect", str(root), "--html", str(tmp_path / "no" / "such" / "map.html")])
    assert result.exit_code == 19, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "map.html" in errors[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "no").exists()
