"""A real headless Chromium (Debian's package) driven over its DevTools protocol, for tests
that look at pages as a user does: open a page, type into it, read its text, take a
screenshot. aiohttp (a Ray dependency) speaks the protocol's websocket; nothing else."""
from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab of a headless Chromium started for it; `close()` ends the browser."""

    def __init__(self, width: int = 1400, height: int = 900):
        self.home = Path(tempfile.mkdtemp(prefix="raysim-chromium-"))
        self.proc = subprocess.Popen([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
                                      "--remote-debugging-port=0", f"--user-data-dir={self.home}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = self.home / "DevToolsActivePort"
        deadline = time.time() + 30
        while not port_file.is_file() or len(port_file.read_text().splitlines()) < 2:
            if time.time() > deadline:
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.1)
        self.port = int(port_file.read_text().splitlines()[0])
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._connect())
        self.size = (width, height)

    async def _connect(self):
        self.http = aiohttp.ClientSession()
        async with self.http.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = json.loads(await r.text())
        self.ws = await self.http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        self.next_id = 0

    async def _send(self, method: str, params: dict | None = None) -> dict:
        self.next_id += 1
        mine = self.next_id
        await self.ws.send_str(json.dumps({"id": mine, "method": method, "params": params or {}}))
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.loop.run_until_complete(self._send(method, params))

    def open(self, url: str) -> None:
        self.send("Page.enable")
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.size[0], "height": self.size[1],
                                                         "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": url})

    def js(self, expression: str):
        out = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        return out.get("result", {}).get("value")

    def text(self) -> str:
        try:
            return self.js("document.body ? document.body.innerText : ''") or ""
        except RuntimeError:  # the page navigated while it was asked (the app's own redirects)
            return ""

    def wait_for_text(self, *needles: str, timeout: float = 60) -> str:
        """The page's text once it holds every needle (ValueError with the text after `timeout`)."""
        deadline = time.time() + timeout
        while True:
            text = self.text()
            if all(n in text for n in needles):
                return text
            if time.time() > deadline:
                raise ValueError(f"page never showed {needles}; it shows: {text[:600]!r}")
            time.sleep(0.5)

    def type_into(self, selector: str, text: str) -> None:
        """Focus the first element matching `selector` and type `text` as keystrokes would."""
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", {"text": text})

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", {"type": kind, "key": "Enter", "code": "Enter",
                                                 "windowsVirtualKeyCode": 13, "nativeVirtualKeyCode": 13})

    def screenshot(self, path: Path) -> None:
        png = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        Path(path).write_bytes(base64.b64decode(png))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.ws.close())
            self.loop.run_until_complete(self.http.close())
        finally:
            self.proc.kill()
            self.proc.wait()
            self.loop.close()
            shutil.rmtree(self.home, ignore_errors=True)
