"""The documentation (README.md, docs/*.md, mkdocs.yml) against the code it describes.

1. The site builds: `python -m mkdocs build --strict` exits 0 (a broken link or anchor between
   pages is a warning, so an error), its nav names every page of docs/, and every page is built;
   the README's links into docs/ (and their anchors) resolve.

2. Every fenced code block is run, checked as data, or marked. The rule:
   - every fence names its language;
   - `<!-- not run: WHY -->` on the line right above a fence: the block is not run; WHY (two
     words at least) says why (installs software, needs torchrun or a store, stands for your own
     files). Any block may carry it; a marker anywhere else, or without a reason, fails;
   - `bash`, `sh`, `console`: run line by line, the blocks of one page in order, in one temporary
     directory per page holding a copy of `examples/` (so a block may use what an earlier one
     wrote). Blank lines and comments are skipped; in `console` blocks only lines after a `$ `
     prompt run (the rest is output). A line of `hpckpt ...` commands (joined by `&&`, nothing else
     of the shell) runs with this environment's `hpckpt`; any other line runs in bash, with this
     environment's `bin/` first on PATH. Every command exits 0, except that
     `<!-- run: exit N -->` above the fence says the block's last command exits N;
   - `python`: executed by this environment's python in the page's directory; it exits 0;
   - `json`: parsed; `jsonc`: parsed once `//` comments are removed; `toml`: parsed by tomllib;
   - `text`: shown output, a synopsis or a diagram: never run, and needs no marker;
   - any other language, or none: fails.
   The README's table of commands is run too: each row's example, in table order (a row whose
   example is `hpckpt run` without `--dry-run` is not: it launches ranks), and the table has a row
   for every command of the CLI.

3. Names: every `hpckpt COMMAND [SUBCOMMAND] ... --option` in a code block or an inline code span
   (also a span that starts with a command's name, `verify --deep`) is a real command with a real
   option of that command (the click tree of `hpckpt.cli.app.app`); a span that is only options
   (`--max-memory 64MiB`) names options some command has (another program's are written with its
   name: `torchrun --standalone`); every keyword in a call of `hpckpt.dist`/`hdist`, `hpckpt.api`/
   `api`, `naming`, `LayoutSpec` (`hdist.save(..., format=...)`, `api.reshard(`, and the bare
   `save(`/`load(`/`async_save(` at the start of a span) is a parameter of the real function; a
   line `hpckpt.dist.NAME(...)` or `hpckpt.api.NAME(...)` in a text block is exactly the
   function's signature (`inspect.signature`, annotations left out); every `HPCKPT_*` variable
   the docs name is read by the package's source (or, for the test suite's own, by tests/).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from _util import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(not[ -]?run|run)\b(.*?)-->\s*$", re.I)
RUNNABLE = {"bash", "sh", "console"}
NO_MARKER_NEEDED = {"text"}
DATA = {"json", "jsonc", "toml"}
BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- reading pages


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    body: str
    marker: str | None  # the marker line above, as written


def fenced_blocks(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks, and the problems of its markers (a stray or malformed one)."""
    lines = text.split("\n")
    blocks, problems, used = [], [], set()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            j += 1
        marker = lines[i - 1] if i > 0 and MARKER.match(lines[i - 1]) else None
        if marker is not None:
            used.add(i - 1)
        blocks.append(Block(page, i + 1, lang, "\n".join(lines[i + 1:j]), marker))
        i = j + 1
    for n, line in enumerate(lines):
        if MARKER.match(line) and n not in used:
            problems.append(f"{page}:{n + 1}: a marker must sit on the line right above a fence: {line.strip()}")
    return blocks, problems


def prose(text: str) -> str:
    """The page without its fenced blocks and HTML comments."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0]
            continue
        if fence is not None:
            if line.strip() and set(line.strip()) == {fence}:
                fence = None
            continue
        out.append(line)
    return re.sub(r"<!--.*?-->", "", "\n".join(out), flags=re.S)


def code_spans(text: str) -> list[str]:
    """Inline code spans of the prose (a span may wrap onto the next line)."""
    return [re.sub(r"\s*\n\s*", " ", m.group(2)).strip()
            for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose(text), re.S)]


def marker_of(block: Block) -> tuple[str | None, str | None, str | None]:
    """(kind, argument, problem): ("not run", WHY) or ("run", "exit N"), or a problem."""
    if block.marker is None:
        return None, None, None
    m = MARKER.match(block.marker)
    kind, rest = m.group(1).lower().replace("-", " "), m.group(2).strip()
    if kind in ("not run", "notrun"):
        reason = rest[1:].strip() if rest.startswith(":") else ""
        if not rest.startswith(":") or len(reason.split()) < 2:
            return None, None, f"{block.page}:{block.line - 1}: `<!-- not run: WHY -->` needs a reason: {block.marker.strip()}"
        return "not run", reason, None
    exit_code = re.fullmatch(r":\s*exit\s+(\d+)", rest)
    if not exit_code:
        return None, None, f"{block.page}:{block.line - 1}: write `<!-- run: exit N -->`: {block.marker.strip()}"
    return "run", exit_code.group(1), None


def block_plan(block: Block) -> tuple[str, str | None]:
    """What to do with a block: ("skip", None), ("run", expected exit), ("data", None), or
    ("fail", why)."""
    kind, arg, problem = marker_of(block)
    if problem:
        return "fail", problem
    if kind == "not run":
        return "skip", None
    if block.lang in NO_MARKER_NEEDED:
        return ("fail", f"{block.page}:{block.line}: a `text` block is never run: drop `<!-- run -->`") \
            if kind == "run" else ("skip", None)
    if block.lang in RUNNABLE or block.lang == "python":
        return "run", arg or "0"
    if block.lang in DATA:
        return "data", None
    what = f"language {block.lang!r}" if block.lang else "no language"
    return "fail", (f"{block.page}:{block.line}: a block with {what} cannot be run: name its language "
                    "(bash, python, json, toml; text for output) or put `<!-- not run: WHY -->` above it")


# ---------------------------------------------------------------- running blocks


def strip_jsonc(text: str) -> str:
    out, i, in_string = [], 0, False
    while i < len(text):
        c = text[i]
        if in_string:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
            out.append(c)
        elif text.startswith("//", i):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def check_data(block: Block) -> str | None:
    try:
        if block.lang == "json":
            json.loads(block.body)
        elif block.lang == "jsonc":
            json.loads(strip_jsonc(block.body))
        else:
            tomllib.loads(block.body)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        return f"{block.page}:{block.line}: the {block.lang} block does not parse: {exc}"
    return None


def shell_lines(block: Block) -> list[str]:
    lines, pending = [], ""
    for raw in block.body.split("\n"):
        line = raw.rstrip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def run_command_line(line: str, cwd: Path) -> tuple[int, str]:
    """Run one line as a user would: a line of `hpckpt` commands (joined by `&&`) with this
    environment's `hpckpt`, one process each; anything else in bash, this environment's `bin/`
    first on PATH. (Not in this process: a command's process-wide state, such as the cache of
    resolved paths, must not carry from one example's directory into the next.)"""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        tokens = []
    parts, part = [], []
    for tok in tokens:
        if tok == "&&":
            parts.append(part)
            part = []
        else:
            part.append(tok)
    parts.append(part)
    shell = any(not p or p[0] != "hpckpt" for p in parts) or any(
        re.search(r"[|;<>$`&]|^\(|\)$", tok) for p in parts for tok in p)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    if shell:
        out = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        return out.returncode, out.stdout + out.stderr
    code, output = 0, ""
    for p in parts:
        out = subprocess.run([str(BIN / "hpckpt"), *p[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=300)
        code, output = out.returncode, output + out.stdout + out.stderr
        if code != 0:
            break
    return code, output


def run_block(block: Block, expected: int, cwd: Path) -> list[str]:
    where = f"{block.page}:{block.line}"
    if block.lang == "python":
        out = subprocess.run([sys.executable, "-c", block.body], cwd=cwd, capture_output=True, text=True, timeout=300)
        return [] if out.returncode == expected else [f"{where}: the python block exited {out.returncode}:\n{out.stderr[-3000:]}"]
    lines = shell_lines(block)
    if not lines:
        return [f"{where}: an empty {block.lang} block"]
    problems = []
    for n, line in enumerate(lines):
        want = expected if n == len(lines) - 1 else 0
        code, output = run_command_line(line, cwd)
        if code != want:
            problems.append(f"{where}: `{line}` exited {code}, not {want}:\n{output[-3000:]}")
            break
    return problems


def page_dir(tmp_path: Path, name: str) -> Path:
    work = tmp_path / name
    work.mkdir()
    shutil.copytree(REPO / "examples", work / "examples")
    return work


def block_problems(text: str, page: str, work: Path | None) -> list[str]:
    """Every problem of the page's blocks; `work`: where to run them (None: plan only)."""
    blocks, problems = fenced_blocks(text, page)
    for block in blocks:
        plan, arg = block_plan(block)
        if plan == "fail":
            problems.append(arg)
        elif plan == "data":
            problem = check_data(block)
            problems += [problem] if problem else []
        elif plan == "run" and work is not None:
            problems += run_block(block, int(arg), work)
    return problems


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_code_block_runs_or_is_marked(page, tmp_path):
    problems = block_problems(page.read_text(), page_id(page), page_dir(tmp_path, page.stem))
    assert not problems, "\n\n".join(problems)


def readme_command_table() -> list[tuple[str, str]]:
    """(command, example) per row of the README's table of commands."""
    section = re.search(r"^## Commands\n(.*?)^## ", (REPO / "README.md").read_text(), re.S | re.M).group(1)
    rows = []
    for line in section.split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[-1].strip("`")))
    return rows


def test_readme_table_of_commands_runs_and_covers_every_command(tmp_path):
    import typer.main

    from hpckpt.cli.app import app

    rows = readme_command_table()
    assert sorted(c for c, _ in rows) == sorted(typer.main.get_command(app).commands), rows
    work = page_dir(tmp_path, "readme-table")
    for command, example in rows:
        assert f"{example} ".startswith(f"hpckpt {command} "), (command, example)
        if command == "run" and "--dry-run" not in example:
            continue  # it launches ranks (torchrun); its names are checked by test_names_the_docs_use_exist
        code, output = run_command_line(example, work)
        assert code == 0, f"README: `{example}` exited {code}:\n{output[-3000:]}"


# ---------------------------------------------------------------- the site


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    import yaml

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["theme"]["name"] in ("mkdocs", "readthedocs")

    def nav_pages(items):
        for item in items:
            for value in (item.values() if isinstance(item, dict) else [item]):
                yield from (nav_pages(value) if isinstance(value, list) else [value])

    pages = sorted(str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md"))
    assert sorted(nav_pages(config["nav"])) == pages, "mkdocs.yml's nav names every page of docs/, once"
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                          "-d", str(site)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for page in pages:
        stem = page[:-3]
        built = site / "index.html" if stem == "index" else site / stem / "index.html"
        assert built.is_file(), f"{page} was not built ({built})"
    for target, anchor in re.findall(r"\]\((docs/[\w./-]+\.md)(?:#([\w-]+))?\)", (REPO / "README.md").read_text()):
        assert (REPO / target).is_file(), f"README links to {target}, which does not exist"
        html = (site / target[len("docs/"):-3] / "index.html").read_text()
        assert not anchor or f'id="{anchor}"' in html, f"README links to {target}#{anchor}: no such heading"


# ---------------------------------------------------------------- names


def cli_tree():
    import typer.main

    from hpckpt.cli.app import app

    return typer.main.get_command(app)


def options_of(command) -> dict[str, bool]:
    """Every spelling of the command's options -> whether it takes a value."""
    found = {"--help": False, "-h": False}
    for param in command.params:
        names = [*param.opts, *param.secondary_opts]
        if not any(n.startswith("-") for n in names):
            continue
        takes_value = not (getattr(param, "is_flag", False) or getattr(param, "count", False))
        found.update({n: takes_value for n in names})
    return found


def every_option(command) -> set[str]:
    found = set(options_of(command))
    for sub in (getattr(command, "commands", None) or {}).values():
        found |= every_option(sub)
    return found


OPTION = re.compile(r"^-{1,2}[A-Za-z][\w-]*")


def clean(token: str) -> str:
    return token.strip("[](){}.,;:'`")


def option_names(token: str) -> list[str]:
    """The options a token names (`--a/--b`, `--opt=value`, `[--json]`), or []."""
    pieces = clean(token).split("/")
    if not all(OPTION.match(p) for p in pieces):
        return []
    return [OPTION.match(p).group(0) for p in pieces]


def is_placeholder(word: str) -> bool:
    return not re.search(r"[a-z]", word)


def check_mention(tokens: list[str], where: str, strict: bool = True) -> list[str]:
    """`hpckpt` followed by `tokens`: the command path and options must exist. Not `strict` (output,
    a comment): a word that is no command means this is no command line, and it is let be."""
    command, path, i = cli_tree(), ["hpckpt"], 0
    problems = []
    while i < len(tokens):
        raw = tokens[i]
        last = raw.rstrip(".,;:)]").endswith("`")  # the end of a quoted command: `hpckpt run` launches
        if last:
            raw = raw.replace("`", "")
        if raw in ("&&", "||", ";", ">", ">>", "<", "2>", "|&") or raw.startswith("#") or raw.startswith("2>"):
            break
        if raw == "|":  # a pipe ends the command; in a synopsis, alternatives go on
            if i + 1 < len(tokens) and clean(tokens[i + 1]).startswith("-"):
                i += 1
                continue
            break
        if '"' in raw:  # the end of a string that quotes the command
            break
        options = options_of(command)
        names = option_names(raw)
        if names:
            for name in names:
                if name not in options:
                    problems.append(f"{where}: `{' '.join(path)}` has no option {name}")
            if len(names) == 1 and options.get(names[0]) and "=" not in raw and getattr(command, "commands", None):
                i += 1  # a group's option value is not its subcommand
            i += 1
            if last:
                break
            continue
        subcommands = getattr(command, "commands", None)
        word = clean(raw)
        if subcommands is not None and word and not is_placeholder(word):
            alternatives = word.split("|")
            missing = [w for w in alternatives if w not in subcommands]
            if missing:
                if strict:
                    problems.append(f"{where}: `{' '.join(path)}` has no command {', '.join(missing)}")
                return problems
            command, path = subcommands[alternatives[0]], [*path, alternatives[0]]
        i += 1
        if last:
            break
    return problems


def mentions(text: str) -> list[str]:
    """The text after each `hpckpt ` in it."""
    return [m.group(1) for m in re.finditer(r"(?<![\w./-])hpckpt[ \t]+(.*)", text)]


def join_continuations(body: str) -> list[str]:
    """A block's lines, a synopsis line continued on indented lines joined to it."""
    lines: list[str] = []
    for line in body.split("\n"):
        if lines and line[:1] in (" ", "\t") and "hpckpt " in lines[-1]:
            lines[-1] += " " + line.strip()
        elif lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + line.strip()
        else:
            lines.append(line)
    return lines


def command_problems(text: str, page: str) -> list[str]:
    tree = cli_tree()
    problems = []
    blocks, _ = fenced_blocks(text, page)
    for block in blocks:
        if block.lang == "python":
            continue  # `hpckpt` there is the package (`from hpckpt import api`); calls are checked below
        for line in join_continuations(block.body):
            for rest in mentions(line):
                problems += check_mention(rest.split(), f"{page}:{block.line}", strict=block.lang in RUNNABLE)
    every = every_option(tree) | {"--version"} | bench_options()
    for span in code_spans(text):
        for rest in mentions(span):
            problems += check_mention(rest.split(), f"{page}: `{span}`")
        words = span.split()
        if not mentions(span) and words and words[0] in tree.commands and len(words) > 1:
            problems += check_mention(words, f"{page}: `{span}`")
        if OPTION.match(span):
            for word in words:
                problems += [f"{page}: `{span}`: no command (nor script in bench/) has the option {name}"
                             for name in option_names(word) if name not in every]
    return problems


def bench_options() -> set[str]:
    """The options of the scripts in bench/ (the benchmark pages quote them)."""
    text = "\n".join(p.read_text(errors="replace") for p in (REPO / "bench").glob("*.py"))
    return set(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", text))


def callables():
    """Qualified names the docs call -> what they name (a module, a class or a function)."""
    import hpckpt.api
    import hpckpt.dist
    from hpckpt.converters import naming
    from hpckpt.core.geometry.layout import LayoutSpec

    return {"hpckpt.dist": hpckpt.dist, "hdist": hpckpt.dist, "hpckpt.api": hpckpt.api, "api": hpckpt.api,
            "hpckpt.converters.naming": naming, "naming": naming, "LayoutSpec": LayoutSpec}


DIST_CALLS = ("save", "async_save", "load", "sharded")
CALL = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)((?:/\w+)*)\(")


def call_arguments(text: str, start: int) -> str:
    depth, i = 0, start
    while i < len(text):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
        i += 1
    return text[start + 1:]


def keywords(arguments: str) -> list[str]:
    pieces, depth, piece = [], 0, ""
    for c in arguments:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(c, 0)
        if c == "," and depth == 0:
            pieces.append(piece)
            piece = ""
        else:
            piece += c
    pieces.append(piece)
    return [m.group(1) for p in pieces if (m := re.match(r"\s*([A-Za-z_]\w*)\s*=(?!=)", p))]


def resolve(qualified: str, names: dict):
    """The object a dotted name in the docs names; None: not hpckpt's; "missing": no such name."""
    parts = qualified.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix, rest = ".".join(parts[:n]), parts[n:]
        if prefix == "dist" and len(rest) == 1 and rest[0] in DIST_CALLS:  # `import hpckpt.dist as dist`
            prefix = "hdist"
        if prefix in names:
            obj = names[prefix]
            for attr in rest:
                if not hasattr(obj, attr):
                    return "missing"
                obj = getattr(obj, attr)
            return obj
    return None


def call_problems(text: str, page: str) -> list[str]:
    names = callables()
    problems = []
    pieces = [b.body for b in fenced_blocks(text, page)[0]] + code_spans(text)
    for piece in pieces:
        for m in CALL.finditer(piece):
            qualified = m.group(1)
            targets = [qualified] + [qualified.rsplit(".", 1)[0] + "." + alt if "." in qualified else alt
                                     for alt in m.group(2).split("/")[1:]]
            for target in targets:
                if "." not in target:
                    if not (target in DIST_CALLS and m.start() == 0 and piece in code_spans(text)):
                        continue
                    target = "hdist." + target  # `save(state_dict, checkpoint_id, *, ...)` in a span
                obj = resolve(target, names)
                if obj is None:
                    continue
                if obj == "missing":
                    problems.append(f"{page}: `{target}` does not exist")
                    continue
                try:
                    parameters = inspect.signature(obj).parameters
                except (TypeError, ValueError):
                    continue
                if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                    continue
                for word in keywords(call_arguments(piece, m.end() - 1)):
                    if word not in parameters:
                        problems.append(f"{page}: `{target}(..., {word}=...)`: {target} has no parameter {word!r}")
    return problems


def plain_signature(obj) -> str:
    sig = inspect.signature(obj)
    return str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty))


def signature_problems(text: str, page: str) -> list[str]:
    names = callables()
    problems = []
    for block in fenced_blocks(text, page)[0]:
        if block.lang != "text":
            continue
        for line in block.body.split("\n"):
            m = re.fullmatch(r"(hpckpt\.(?:dist|api)\.\w+)(\(.*\))", line.strip())
            if not m:
                continue
            obj = resolve(m.group(1), names)
            if obj in (None, "missing"):
                problems.append(f"{page}:{block.line}: `{m.group(1)}` does not exist")
            elif m.group(2) != plain_signature(obj):
                problems.append(f"{page}:{block.line}: `{m.group(1)}` is documented as\n  {m.group(2)}\n"
                                f"but its signature is\n  {plain_signature(obj)}")
    return problems


def source_text(folders: list[str], top_files: bool) -> str:
    files = [p for f in folders for p in (REPO / f).rglob("*.py")]
    if top_files:
        files += list(REPO.glob("*.py"))
    return "\n".join(p.read_text(errors="replace") for p in files)


def variable_problems(text: str, page: str, package: str, tests: str) -> list[str]:
    return [f"{page}: {name} is read by no code of the package (cli/ core/ api/ converters/ dist/) nor tests/"
            for name in sorted({v.rstrip("_") for v in re.findall(r"HPCKPT_[A-Z_]+", text)})
            if name not in package and name not in tests]


def test_names_the_docs_use_exist():
    package = source_text(["cli", "core", "api", "converters", "dist"], top_files=True)
    tests = source_text(["tests"], top_files=False)
    problems = []
    for page in PAGES:
        text, name = page.read_text(), page_id(page)
        problems += command_problems(text, name) + call_problems(text, name) + signature_problems(text, name)
        problems += variable_problems(text, name, package, tests)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the checks fail when they should


def test_the_checks_catch_what_they_must(tmp_path):
    fence = "`" * 3
    page = "\n".join([
        f"{fence}ruby", "puts 1", fence,                                 # a language nobody runs
        f"{fence}", "plain", fence,                                       # no language
        "<!-- not run -->", f"{fence}bash", "hpckpt env", fence,          # a marker without a reason
        "<!-- not run: x -->", f"{fence}bash", "hpckpt env", fence,       # a one-word reason
        "<!-- not run: far from any fence -->", "",
        f"{fence}json", "{\"a\": 1,}", fence,                             # JSON that does not parse
        f"{fence}bash", "hpckpt inspect examples/tiny-hp --no-such-option", fence,
        f"{fence}python", "raise SystemExit(3)", fence,
        "<!-- run: exit 25 -->", f"{fence}bash", "hpckpt env", fence,     # exits 0, not 25
        "<!-- not run: it stands for your own files -->", f"{fence}bash", "hpckpt inspect nowhere/", fence,
        f"{fence}text", "anything at all", fence,
    ])
    problems = block_problems(page, "page.md", page_dir(tmp_path, "page"))
    expected = ["language 'ruby'", "no language", "needs a reason", "needs a reason", "right above a fence",
                "does not parse", "--no-such-option", "python block exited 3", "exited 0, not 25"]
    assert len(problems) == len(expected), "\n".join(problems)
    for what in expected:
        assert sum(what in p for p in problems) == expected.count(what), (what, problems)

    wrong = "\n".join([
        "Run `hpckpt inspect ckpt/ --deeep` or `hpckpt reshrd x -o y`, `verify --bogus`, `--no-such-flag`,",
        "`hpckpt run --nproc-per-node 2 sav -o x`, `hpckpt run bench --layout-file f`,",
        "`hdist.save(sd, checkpoint_id='x', path='y')`, `hpckpt.dist.save/load(..., pth=1)`,",
        "`api.reshard(a, b, c, world_size=8)`, `api.no_such_function()`, `HPCKPT_NO_SUCH_VARIABLE`.",
        "", f"{fence}text", "hpckpt.dist.load(state_dict, path)", fence,
        "", f"{fence}bash", "hpckpt consolidate x -o y --format pt --shard-size 5GB", fence,
        "", f"{fence}python", "hdist.load(state, 'ckpt', strictly=True)", fence,
    ])
    found = (command_problems(wrong, "w.md") + call_problems(wrong, "w.md") + signature_problems(wrong, "w.md")
             + variable_problems(wrong, "w.md", source_text(["core"], True), ""))
    for what in ["no option --deeep", "no command reshrd", "`hpckpt verify` has no option --bogus",
                 "option --no-such-flag", "no command sav", "`hpckpt run bench` has no option --layout-file",
                 "no parameter 'path'", "save has no parameter 'pth'", "load has no parameter 'pth'",
                 "no parameter 'world_size'", "`api.no_such_function` does not exist", "HPCKPT_NO_SUCH_VARIABLE",
                 "`hpckpt.dist.load` is documented as", "no option --shard-size", "no parameter 'strictly'"]:
        assert any(what in p for p in found), (what, found)
    right = ("`hpckpt run --nproc-per-node 4 bench --size 1GiB --json`, `hpckpt --json inspect x`, "
             "`hdist.save(state_dict=s, checkpoint_id='c', no_dist=True)`, `torch.load(f, weights_only=True)`, "
             "`hpckpt completion bash|zsh|fish`, `convert --to mindformers`, `dist.destroy_process_group()`")
    assert not command_problems(right, "r.md") + call_problems(right, "r.md")
