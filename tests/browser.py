"""A real browser for tests: Chromium's headless shell driven over the DevTools protocol.

    chrome = find_chromium()            # None when there is none (the test then skips, saying how to get one)
    seen = render(chrome, page, "shot.png", width=1400)
    seen["images"], seen["console"]    # every <img>: (src, loaded, width, height); console errors and failed loads

The browser is Debian's `chromium-headless-shell`: on PATH, or unpacked without root into
.cache/chromium by `make chromium` (.ci/fetch-chromium: `apt-get download` of the package and of
the libraries it needs that this machine lacks, `dpkg-deb -x`), run with those libraries on
LD_LIBRARY_PATH. The protocol goes over a WebSocket (aiohttp, which Ray's dashboard brings).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHED = REPO / ".cache" / "chromium" / "root"
HOW_TO_GET = ("no Chromium: run `make chromium` (apt-get download of Debian's chromium-headless-shell and the "
              "libraries this machine lacks, unpacked into .cache/chromium without root), or put "
              "chromium-headless-shell on PATH")


def find_chromium() -> tuple[list[str], dict] | None:
    """(command, environment) of a headless Chromium, or None."""
    for name in ("chromium-headless-shell", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return [found], dict(os.environ)
    binary = CACHED / "usr" / "lib" / "chromium" / "chromium-headless-shell"
    if not binary.exists():
        return None
    libs = [str(CACHED / "usr" / "lib" / "x86_64-linux-gnu"), str(CACHED / "usr" / "lib" / "x86_64-linux-gnu" /
                                                                    "pulseaudio")]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([*libs, os.environ.get("LD_LIBRARY_PATH", "")])}
    return [str(binary)], env


class _Tab:
    """One page's DevTools session: commands by id, every event kept."""

    def __init__(self, ws):
        self.ws, self.n, self.events = ws, 0, []

    async def call(self, method: str, **params) -> dict:
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive(timeout=60)).data)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    async def until(self, event: str, timeout_s: float = 60) -> None:
        deadline = time.time() + timeout_s
        while not any(e.get("method") == event for e in self.events):
            msg = json.loads((await self.ws.receive(timeout=max(0.1, deadline - time.time()))).data)
            self.events.append(msg)


def _problems(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed loads the page produced."""
    out = []
    for e in events:
        p = e.get("params", {})
        if e.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif e.get("method") == "Runtime.exceptionThrown":
            out.append("exception: " + p["exceptionDetails"].get("text", ""))
        elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}".strip())
    return out


async def _drive(ws_url: str, page: Path, png: Path, width: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        tab = _Tab(ws)
        for domain in ("Page", "Runtime", "Log"):
            await tab.call(f"{domain}.enable")
        await tab.call("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False)
        await tab.call("Page.navigate", url=page.resolve().as_uri())
        await tab.until("Page.loadEventFired")
        images = json.loads((await tab.call("Runtime.evaluate", returnByValue=True, expression=(
            "JSON.stringify([...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0, "
            "i.naturalWidth, i.naturalHeight]))")))["result"]["value"])
        size = (await tab.call("Page.getLayoutMetrics"))["cssContentSize"]
        await tab.call("Emulation.setDeviceMetricsOverride", width=width, height=int(size["height"]),
                       deviceScaleFactor=1, mobile=False)
        shot = await tab.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        png.write_bytes(base64.b64decode(shot["data"]))
        return {"images": [tuple(i) for i in images], "console": _problems(tab.events),
                "height": int(size["height"])}


def render(chrome: tuple[list[str], dict], page: str | os.PathLike, png: str | os.PathLike,
           width: int = 1400) -> dict:
    """Open `page` (a local HTML file) in headless Chromium, wait for it to load, check its images
    and collect console problems, and write a full-page screenshot to `png`."""
    cmd, env = chrome
    with tempfile.TemporaryDirectory(prefix="k3-chrome-") as profile:
        proc = subprocess.Popen([*cmd, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                 "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                                 f"--user-data-dir={profile}", "about:blank"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            browser_ws = None
            for line in proc.stderr:  # the browser prints its DevTools address first
                m = re.search(r"DevTools listening on (ws://\S+)", line)
                if m:
                    browser_ws = m.group(1)
                    break
            if browser_ws is None:
                raise RuntimeError(f"Chromium did not start (exit {proc.wait(timeout=10)})")
            port = re.search(r":(\d+)/", browser_ws).group(1)
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                tab_ws = next(t["webSocketDebuggerUrl"] for t in json.loads(r.read()) if t["type"] == "page")
            return asyncio.run(_drive(tab_ws, Path(page), Path(png), width))
        finally:
            proc.kill()
            proc.wait(timeout=30)
