"""A real Azure Blob Storage server for the tests: Azurite (Microsoft's emulator, from the npm
registry; the README's test command installs it under `tests/.node/`) on 127.0.0.1, in its own
process, with a throw-away data directory; and the environment that points obstore (hence
hpckpt's `az://` URLs) at it. Containers are made here with one signed REST call (Shared Key, the
emulator's published development account), as a user would make them with their own tools."""

from __future__ import annotations

import base64
import hashlib
import hmac
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from email.utils import formatdate
from pathlib import Path

AZURITE = Path(__file__).resolve().parent / ".node" / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"  # the emulator's development account and its published key
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class Azurite:
    """`with Azurite() as server:` a running blob service; `server.environment` for hpckpt."""

    def __enter__(self) -> "Azurite":
        if not AZURITE.exists():
            raise RuntimeError(f"{AZURITE} is missing: run the README's test command "
                               "(it installs Azurite with npm)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.data = Path(tempfile.mkdtemp(prefix="hpckpt-azurite-"))
        self.proc = subprocess.Popen([str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                                      "--location", str(self.data), "--silent", "--skipApiVersionCheck"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.__exit__(None, None, None)
                    raise RuntimeError("Azurite did not start") from None
                time.sleep(0.1)
        self.environment = {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": self.url,
                            "HPCKPT_STORE_RETRY_SECONDS": "20"}
        return self

    def create_container(self, name: str) -> None:
        date = formatdate(usegmt=True)
        headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        to_sign = "PUT\n" + "\n" * 11 + canonical_headers + f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"
        signature = base64.b64encode(hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest())
        request = urllib.request.Request(f"{self.url}/{ACCOUNT}/{name}?restype=container", method="PUT",
                                         headers={**headers, "Authorization": f"SharedKey {ACCOUNT}:{signature.decode()}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 201, answer.status

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)
