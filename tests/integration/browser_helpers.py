"""Headless Chromium over the DevTools protocol, with the standard library only.

A page is loaded by the real browser, then asked what it shows: each ``<img>``'s decoded
size, and a screenshot. The websocket client is the minimum the protocol needs (masked text
frames out; text, continuation, ping and close frames in).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

# Headless as root on a machine without outside network: the background services would try to
# connect out and have their connections refused.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]

# What each <img> of the page decoded to, read once the load event has fired.
IMAGES_JS = ("JSON.stringify(Array.from(document.images).map(i => "
             "({src: i.getAttribute('src'), complete: i.complete, width: i.naturalWidth, height: i.naturalHeight})))")


def find_chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class WebSocket:
    """A client websocket over a plain TCP socket (RFC 6455), enough for DevTools."""

    def __init__(self, url: str, timeout: float):
        assert url.startswith("ws://"), url
        hostport, _, path = url[len("ws://"):].partition("/")
        host, _, port = hostport.partition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the websocket handshake")
            head += chunk
        status = head.split(b"\r\n", 1)[0].decode(errors="replace")
        if " 101 " not in status:
            raise ConnectionError(f"DevTools refused the websocket: {status}")

    def send(self, text: str) -> None:
        self._send_frame(0x1, text.encode())

    def _send_frame(self, opcode: int, data: bytes) -> None:
        n = len(data)
        head = bytes([0x80 | opcode])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools closed the websocket")
            buf += chunk
        return bytes(buf)

    def recv(self) -> str:
        """The next whole text message (fragments joined; pings answered)."""
        message = bytearray()
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            mask = self._exact(4) if b1 & 0x80 else None
            data = self._exact(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the websocket")
            if opcode == 0x9:
                self._send_frame(0xA, data)
                continue
            message += data
            if b0 & 0x80 and opcode in (0x0, 0x1):
                return message.decode()

    def close(self) -> None:
        self.sock.close()


class DevToolsPage:
    """One page target of a running browser: send a command, wait for its result or an event."""

    def __init__(self, ws_url: str, timeout: float):
        self.ws = WebSocket(ws_url, timeout)
        self.timeout = timeout
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(f"DevTools {method}: no answer in {self.timeout} s")

    def wait_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for i, ev in enumerate(self.events):
                if ev["method"] == method:
                    return self.events.pop(i)
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(f"DevTools: no {method} in {self.timeout} s")


def _devtools_port(profile: Path, proc: subprocess.Popen, timeout: float) -> int:
    """The port the browser chose (--remote-debugging-port=0 writes it into the profile)."""
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before DevTools listened")
        if port_file.is_file():
            text = port_file.read_text().split()
            if text:
                return int(text[0])
        time.sleep(0.1)
    raise TimeoutError(f"chromium opened no DevTools port in {timeout} s")


def load_and_inspect(chromium: str, page: Path, screenshot: Path, width: int = 1200, height: int = 900,
                     timeout: float = 60.0) -> list[dict]:
    """Open ``page`` (a local HTML file) in headless Chromium, wait for its load event (every
    image fetched and decoded or failed), write a full-page PNG screenshot to ``screenshot``
    and return what each ``<img>`` decoded to: src, complete, width and height (natural)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        proc = subprocess.Popen([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                 f"--window-size={width},{height}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            port = _devtools_port(Path(profile), proc, timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout) as r:
                targets = [t for t in json.load(r) if t.get("type") == "page"]
            if not targets:
                raise RuntimeError("chromium has no page target")
            tab = DevToolsPage(targets[0]["webSocketDebuggerUrl"], timeout)
            try:
                tab.call("Page.enable")
                tab.call("Page.navigate", url=page.resolve().as_uri())
                tab.wait_event("Page.loadEventFired")
                result = tab.call("Runtime.evaluate", expression=IMAGES_JS, returnByValue=True)
                images = json.loads(result["result"]["value"])
                shot = tab.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            finally:
                tab.ws.close()
            return images
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
