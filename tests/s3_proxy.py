"""A fault-injecting HTTP proxy in front of the S3 server, on 127.0.0.1, for the object-store
tests: it forwards every request, counts the bytes of each response body by object key, and
on request answers some with a 503, cuts a body off half-way (a connection reset), or delays
them. `faults` is changed by the test while the proxy runs."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class Faults:
    """What to do to the next requests: each rule applies to requests whose method and path
    match and is used up after `count` requests."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rules: list[dict] = []

    def add(self, kind: str, *, method: str = "GET", contains: str = "", count: int = 1, delay: float = 0.0,
            from_byte: int = 0):
        """`from_byte`: only ranged GETs that start there or later (a file's data, not its header)."""
        with self.lock:
            self.rules.append({"kind": kind, "method": method, "contains": contains, "left": count, "delay": delay,
                               "from_byte": from_byte})

    def take(self, method: str, path: str, byte_range: str | None = None) -> dict | None:
        start = int(byte_range.removeprefix("bytes=").split("-")[0]) if byte_range else 0
        with self.lock:
            for rule in self.rules:
                if (rule["left"] > 0 and rule["method"] == method and rule["contains"] in path
                        and start >= rule["from_byte"]):
                    rule["left"] -= 1
                    return rule
        return None

    def left(self) -> int:
        with self.lock:
            return sum(r["left"] for r in self.rules)


class Proxy:
    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.upstream = (target.hostname, target.port)
        self.faults = Faults()
        self.body_bytes: Counter[str] = Counter()  # object key -> response body bytes sent
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.lock = threading.Lock()
        self.in_flight = 0  # requests being handled (a killed client's may still reach the server)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                with proxy.lock:
                    proxy.in_flight += 1
                try:
                    self._relay()
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _relay(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                proxy.requests.append((self.command, self.path, self.headers.get("Range")))
                rule = proxy.faults.take(self.command, self.path, self.headers.get("Range"))
                if rule is not None and rule["kind"] == "503":
                    payload = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if rule is not None and rule["kind"] == "slow":
                    time.sleep(rule["delay"])
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if rule is not None and rule["kind"] == "reset" and len(data) > 1:
                    self.wfile.write(data[:len(data) // 2])
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    self.close_connection = True
                    return
                self.wfile.write(data)
                key = urlsplit(self.path).path
                proxy.body_bytes[key] += len(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until no request is being handled: what a killed client had sent lands first."""
        deadline = time.time() + timeout
        while self.in_flight and time.time() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> "Proxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
