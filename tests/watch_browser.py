"""A real browser for the live page's tests: Debian's headless Chromium, driven over the Chrome
DevTools protocol (its HTTP endpoints and one websocket per call, through aiohttp)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Browser:
    """One headless Chromium with one tab; `evaluate` runs JavaScript in the page."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 1000):
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port within 60 s")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        tabs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10))
        self.ws_url = next(t["webSocketDebuggerUrl"] for t in tabs if t["type"] == "page")

    async def _call(self, method: str, params: dict) -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(
                self.ws_url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=10)
            ) as ws:
                await ws.send_json({"id": 1, "method": method, "params": params})
                while True:
                    msg = await asyncio.wait_for(ws.receive_json(), timeout=60)
                    if msg.get("id") == 1:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg["result"]

    def call(self, method: str, **params) -> dict:
        return asyncio.run(self._call(method, params))

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0):
        """Poll `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied {expression!r} in {timeout_s:.0f} s")
            time.sleep(0.25)

    def screenshot(self, path: Path) -> None:
        import base64

        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def check_gap_colours(browser: Browser, sample: dict) -> None:
    """With the inspector coloured by logprob gap, each token of the newest sample shown (which
    must be `sample`, a samples.jsonl row) carries |trainer - engine| of the file in its title
    and `data-gap`, and the colour `gapColour` gives that gap; the legend gives the scale."""
    import re

    browser.evaluate(
        "(() => { const e = document.getElementById('f-colour'); e.value = 'gap';"
        " e.dispatchEvent(new Event('input')); })()"
    )
    toks = browser.evaluate(
        "[...document.querySelector('#sample-list .sample').querySelectorAll('.tok')]"
        ".map(t => [t.textContent, t.dataset.gap, t.title, t.style.background])"
    )
    assert [t[0] for t in toks] == sample["tokens"]
    for (_, gap, title, colour), t, e in zip(toks, sample["trainer_logprobs"], sample["token_logprobs"]):
        if t is None:  # an environment token: no trainer logprob, no gap
            assert gap == "" and "trainer logprob" not in title
            continue
        assert abs(float(gap) - abs(t - e)) < 1e-9
        assert float(re.search(r"trainer logprob (\S+),", title).group(1)) == t
        expected = browser.evaluate(
            f"(() => {{ const s = document.createElement('span');"
            f" s.style.background = gapColour({float(gap)}); return s.style.background; }})()"
        )
        assert colour == expected
    legend = browser.evaluate("document.getElementById('legend').textContent")
    assert "trainer" in legend and legend.count("nats") >= 3
