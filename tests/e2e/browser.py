"""Headless Chromium driven over the DevTools protocol (CDP), as a person would use the web UI.

Debian's ``chromium`` runs headless with a fresh profile and its DevTools endpoint on 127.0.0.1;
we talk CDP over a websocket (``websocket-client``): navigate, type into inputs with real key
events, click, and capture screenshots. No driver binary and no browser download are needed.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import requests
import websocket

from training.util import stop_process

DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-quic"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, *, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self.profile = Path(tempfile.mkdtemp(prefix="chromium-profile-"))
        self.proc: subprocess.Popen | None = None
        self.ws: websocket.WebSocket | None = None
        self._id = 0

    def start(self, timeout: float = 60) -> "Browser":
        exe = chromium_path()
        assert exe, "chromium is not installed (apt-get install -y chromium)"
        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = self.profile / "DevToolsActivePort"  # Chromium writes the port it picked here
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"chromium did not open its DevTools port (exit code {self.proc.poll()})")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        # suppress_origin: Chromium refuses DevTools websockets that send a foreign Origin header.
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        return self

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, 20)
        shutil.rmtree(self.profile, ignore_errors=True)

    # ------------------------------------------------------------------ protocol
    def send(self, method: str, **params: Any) -> dict[str, Any]:
        assert self.ws is not None
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    # ------------------------------------------------------------------ what a person does
    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout: float = 90, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = self.eval(expression)
            except RuntimeError:  # the page is between documents (navigation, redirect)
                value = None
            if value:
                return value
            time.sleep(0.3)
        raise TimeoutError(f"waited {timeout}s for {what or expression}; page text: {self.text()[:1500]!r}")

    def text(self) -> str:
        try:
            return self.eval("document.body ? document.body.innerText : ''") or ""
        except RuntimeError:
            return ""

    def type_into(self, selector: str, text: str) -> None:
        """Focus the field and type with real key input (React sees ordinary input events)."""
        self.wait_for(f"!!document.querySelector({json.dumps(selector)})", what=selector)
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      **({"text": "\r"} if kind == "keyDown" else {}))

    def click_button(self, label: str, timeout: float = 60, within: str = "document") -> None:
        """Click the first visible button whose text is ``label`` (with a real mouse event);
        ``within``: a JS expression for the element to search in (e.g. a dialog)."""
        find = (f"(() => {{ const root = {within}; if (!root) return null; "
                "const b = [...root.querySelectorAll('button')].find(b => b.innerText.trim() === "
                f"{json.dumps(label)} && b.offsetParent !== null); if (!b) return null; "
                "b.scrollIntoView({block: 'center'}); const r = b.getBoundingClientRect(); "
                "return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        x, y = self.wait_for(find, timeout=timeout, what=f"button {label!r}")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: str | Path, *, fmt: str = "png") -> Path:
        data = self.send("Page.captureScreenshot", format=fmt, **({"quality": 80} if fmt != "png" else {}))["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


def keep_screenshot(path: Path) -> None:
    """With UPDATE_SCREENSHOTS=1 (`make screenshots`), keep a small copy (128-colour palette PNG) in
    docs/images/, where the README shows it."""
    if os.environ.get("UPDATE_SCREENSHOTS") == "1":
        from PIL import Image

        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        Image.open(path).convert("RGB").quantize(colors=128).save(DOCS_IMAGES / path.name, optimize=True)


def login(b: Browser, af: Any, path: str) -> None:
    """Open ``path`` of the live Airflow ``af``; not logged in, the UI sends us to its login form first."""
    from tests.e2e.live_airflow import PASSWORD

    b.goto(af.base + path)
    b.type_into("input[name=username]", "admin")
    b.type_into("input[name=password]", PASSWORD)
    b.press_enter()
    b.wait_for(f"decodeURIComponent(location.pathname) === {json.dumps(path)}", what=f"{path} after login")


def close_mlflow_assistant(b: Browser) -> None:
    """MLflow's chat side panel opens by itself in a fresh profile and narrows the page."""
    b.eval("[...document.querySelectorAll('button[aria-label=Close]')].forEach(x => x.click())")
