"""Text syntax of meshes ("2x4") and placements ("R,S0"), as the command line and rules files give them.

Placement text (`parse_placements`, one token per mesh dim): `R`, `S<d>` or `S(<d>)`, optionally
`S<d>:ceil` / `S<d>:balanced`, and `Ragged(<dims>;<units>)`.
"""

from __future__ import annotations

import re

from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import Placement, RaggedShard, Replicate, Shard, check_rule

_SHARD = re.compile(r"S(?:HARD)?(?:(\d+)|\(\s*(\d+)\s*\))(?::(\w+))?", re.IGNORECASE)
_RAGGED = re.compile(r"RAGGED\(\s*([\d,\s]+);([\d,\s]+)\)", re.IGNORECASE)


def parse_mesh(text: str) -> Mesh:
    """Parse "2x4" (also "2,4", "8", "(2, 4)") into a Mesh with the default ranks.

    Raises:
        ValueError: not a list of positive integers.
    """
    body = re.sub(r"\s+", "", text).strip("()[]").lower()
    if not re.fullmatch(r"\d+(?:[x×,*]\d+)*", body):
        raise ValueError(f"bad mesh {text!r}: expected sizes like '8' or '2x4'")
    sizes = tuple(int(p) for p in re.split(r"[x×,*]", body))
    if not all(sizes):
        raise ValueError(f"bad mesh {text!r}: every size must be >= 1")
    return Mesh(sizes)


def parse_placements(text: str, rule: str = "balanced") -> tuple[Placement, ...]:
    """Parse placements, one per mesh dim, e.g. "R,S0", "[S(0), S1:ceil]", "Ragged(0,1;7,8,0,15)".

    Tokens: `R` (Replicate); `S<d>` or `S(<d>)` (Shard of tensor dim d with `rule`), optionally
    suffixed `:balanced` or `:ceil` to override `rule`; `Ragged(<dims>;<units>)` (RaggedShard).
    `str()` of a placement tuple element round-trips with the default rule.

    Raises:
        ValueError: an unknown token or split rule.
    """
    check_rule(rule)
    tokens = _split_top_level(text.strip().removeprefix("[").removesuffix("]"))
    if not tokens:
        raise ValueError(f"bad placements {text!r}: expected e.g. 'R,S0'")
    return tuple(_parse_token(t, rule) for t in tokens)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses (Ragged(...) contains commas).

    Raises:
        ValueError: an empty token, as in "R,,S0".
    """
    if not text.strip():
        return []
    out, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    out.append(current.strip())
    if not all(out):
        raise ValueError(f"bad placements {text!r}: empty entry")
    return out


def _parse_token(token: str, rule: str) -> Placement:
    if token.upper() in ("R", "REPLICATE", "REPLICATE()"):
        return Replicate()
    m = _SHARD.fullmatch(token)
    if m:
        return Shard(int(m.group(1) or m.group(2)), check_rule((m.group(3) or rule).lower()))
    m = _RAGGED.fullmatch(token)
    if m:
        dims, units = ([int(x) for x in g.split(",") if x.strip()] for g in m.groups())
        return RaggedShard(tuple(dims), tuple(units))
    raise ValueError(f"bad placement {token!r}: expected R, S<dim>, S(<dim>), S<dim>:ceil or Ragged(<dims>;<units>)")

