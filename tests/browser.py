"""A real headless Chromium (the distribution's package, installed by the README's test command)
for the tests of hpckpt's HTML pages: the DOM after the page's script ran, a screenshot, and a
count of the network connections the page tried (every request is sent to a proxy on 127.0.0.1
that only counts; loopback is proxied too, and nothing leaves the machine)."""

from __future__ import annotations

import shutil
import socket
import struct
import subprocess
import threading
import zlib
from pathlib import Path

import numpy as np

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--metrics-recording-only", "--disable-features=NetworkTimeServiceQuerying",
         "--virtual-time-budget=10000"]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium is not installed: the README's test command installs it (apt-get install chromium)"
    return found


#: Chromium's own services: asked for on a blank page as well (both on each of 8 blank pages here),
#: though not always before a run's virtual time ends, so a blank page's list alone can miss one
#: (a CI run saw accounts.google.com only on the page's run). Hosts a page would load from (fonts,
#: CDNs, an image's host) are not among them.
BROWSER_SERVICES = frozenset({"accounts.google.com", "www.google.com"})


class CountingProxy:
    """A TCP listener on 127.0.0.1 that accepts, records and drops every connection. The browser
    itself asks for a few of its own services even on a blank page (update checks, accounts):
    `hosts` names who was asked, so a page's requests are those a blank page does not make."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.requests.append(conn.recv(4096))
                except OSError:
                    self.requests.append(b"")

    def hosts(self) -> set[str]:
        """The hosts asked for (`CONNECT host:port`, or the host of an absolute `GET http://...`)."""
        out = set()
        for request in self.requests:
            line = request.split(b"\r\n", 1)[0].decode("latin-1")
            target = line.split(" ")[1] if " " in line else ""
            out.add(target.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0])
        return out

    def close(self) -> None:
        self.sock.close()


def render(url: str, *, profile: Path, screenshot: Path | None = None, size: str = "1300,900",
           proxy: CountingProxy | None = None) -> str:
    """The DOM of `url` once its script ran (and a PNG at `screenshot`)."""
    flags = [*FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"]
    if proxy is not None:
        flags += [f"--proxy-server=http://127.0.0.1:{proxy.port}", "--proxy-bypass-list=<-loopback>"]
    if screenshot is not None:
        done = subprocess.run([chromium(), *flags, f"--screenshot={screenshot}", url], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0 and screenshot.is_file(), done.stderr[-2000:]
    done = subprocess.run([chromium(), *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def png_pixels(path: Path) -> np.ndarray:
    """The pixels of an 8-bit RGB or RGBA PNG (what Chromium writes) as `[height, width, 3]`."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and not interlace, header
    step = 3 if colour == 2 else 4
    stride = width * step
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), np.uint8)
    previous = np.zeros(stride, np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 2:
            line = (line + previous) & 255
        elif kind in (1, 3, 4):  # each byte depends on the one to its left: byte by byte
            for i in range(stride):
                left = line[i - step] if i >= step else 0
                up, corner = previous[i], previous[i - step] if i >= step else 0
                if kind == 1:
                    predicted = left
                elif kind == 3:
                    predicted = (left + up) // 2
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    predicted = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + predicted) & 255
        out[y] = line
        previous = line
    return out.reshape(height, width, step)[:, :, :3]


def colours(path: Path) -> dict[tuple[int, int, int], int]:
    """How many pixels of each RGB colour a screenshot holds."""
    pixels = png_pixels(path).reshape(-1, 3)
    values, counts = np.unique(pixels, axis=0, return_counts=True)
    return {tuple(int(c) for c in v): int(n) for v, n in zip(values, counts)}
