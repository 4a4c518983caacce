"""Open an HTML file in headless Chromium and report what a person would see: console errors,
uncaught exceptions, whether every plot rendered, and a PNG screenshot.

Talks the DevTools protocol over `--remote-debugging-pipe` (JSON messages separated by NUL
on the child's fds 3 and 4), so no client library and no network port is needed. Chromium is
Debian's `chromium` package (`.ci/run` installs it).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

INSTALL_HINT = "headless Chromium is needed: install it with `apt-get install -y chromium` (as root on Debian)"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync", "--hide-scrollbars", "--mute-audio",
         "--remote-debugging-pipe")

# Every figure.plot must hold an <svg class="chart"> that the browser laid out with a real
# size and that draws something (paths, marker uses, text or an embedded image).
PLOT_CHECK = """(() => {
  const out = [];
  for (const fig of document.querySelectorAll('figure.plot')) {
    const svg = fig.querySelector('svg.chart');
    const r = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    const drawn = svg ? svg.querySelectorAll('path, use, image, text, rect').length : 0;
    const images = svg ? [...svg.querySelectorAll('image')].map(i => (i.getAttribute('xlink:href') ||
        i.getAttribute('href') || '').slice(0, 22)) : [];
    out.push({name: fig.dataset.plot, width: r.width, height: r.height, drawn: drawn, images: images});
  }
  // Every table sits in a div.scroll: wider than its box, part of it is out of sight.
  const tables = [...document.querySelectorAll('div.scroll')].map(d => ({
      cls: (d.querySelector('table') || {}).className || '', width: d.scrollWidth, box: d.clientWidth}));
  return {plots: out, title: document.title, missing: [...document.querySelectorAll('[data-missing]')]
      .map(e => e.dataset.missing), height: document.documentElement.scrollHeight, tables: tables};
})()"""


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageCheck:
    plots: list[dict]
    title: str
    missing: list[str]
    console_errors: list[str] = field(default_factory=list)
    screenshot: bytes | None = None
    tables: list[dict] = field(default_factory=list)  # {cls, width, box}: each table's width and its box's

    @property
    def overflowing(self) -> list[dict]:
        """The tables wider than the box they sit in (part of each out of sight)."""
        return [t for t in self.tables if t["width"] > t["box"]]


class _Pipe:
    def __init__(self, exe: str, profile: str) -> None:
        cmd_r, cmd_w = os.pipe()
        resp_r, resp_w = os.pipe()
        # Park the child's ends above 10 so dup2 onto 3 and 4 cannot overwrite one another.
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, resp_w)]
        for fd in (cmd_r, resp_w):
            os.close(fd)

        def child_fds() -> None:
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     # Python's own fds are close-on-exec (PEP 446); only 3 and 4,
                                     # made by dup2 after the fork, reach Chromium.
                                     preexec_fn=child_fds, close_fds=False)
        for fd in high:
            os.close(fd)
        self.w, self.r = cmd_w, resp_r
        self.buf = b""
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, *, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for m in self._read(deadline):
                if m.get("id") == self.next_id:
                    if "error" in m:
                        raise RuntimeError(f"{method}: {m['error']}")
                    return m.get("result", {})
                self.events.append(m)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for n, e in enumerate(self.events):
                if e.get("method") == method:
                    return self.events.pop(n)
            self.events.extend(self._read(deadline))

    def _read(self, deadline: float) -> list[dict]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("Chromium did not answer in time")
        ready, _, _ = select.select([self.r], [], [], left)
        if not ready:
            raise TimeoutError("Chromium did not answer in time")
        chunk = os.read(self.r, 1 << 20)
        if not chunk:
            raise RuntimeError("Chromium closed the DevTools pipe: " + self.stderr_tail())
        self.buf += chunk
        *msgs, self.buf = self.buf.split(b"\0")
        return [json.loads(m) for m in msgs if m]

    def stderr_tail(self) -> str:
        try:
            self.proc.wait(timeout=5)
            return (self.proc.stderr.read() or b"").decode(errors="replace")[-2000:]
        except subprocess.TimeoutExpired:
            return "(still running)"

    def close(self) -> None:
        try:
            os.write(self.w, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            for fd in (self.w, self.r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            if self.proc.stderr:
                self.proc.stderr.close()


def check_page(path: Path, *, width: int = 1200, height: int = 900, screenshot: str | None = None,
               timeout: float = 60.0) -> PageCheck:
    """Load `path` and return what rendered. `screenshot`: None, "viewport" or "full"."""
    exe = chromium()
    if exe is None:
        raise RuntimeError(INSTALL_HINT)
    with tempfile.TemporaryDirectory(prefix="packbench-chromium-") as profile:
        pipe = _Pipe(exe, profile)
        try:
            target = pipe.send("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False}, session=session)
            pipe.send("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
            pipe.wait_event("Page.loadEventFired", timeout=timeout)
            result = pipe.send("Runtime.evaluate", {"expression": PLOT_CHECK, "returnByValue": True},
                               session=session)["result"]["value"]
            shot = None
            if screenshot:
                if screenshot == "full":
                    pipe.send("Emulation.setDeviceMetricsOverride",
                              {"width": width, "height": int(result["height"]), "deviceScaleFactor": 1,
                               "mobile": False}, session=session)
                shot = base64.b64decode(pipe.send("Page.captureScreenshot", {"format": "png"}, session=session,
                                                  timeout=timeout)["data"])
            # Let late console messages arrive, then read every event seen.
            try:
                pipe.send("Runtime.evaluate", {"expression": "1"}, session=session)
            except RuntimeError:
                pass
            errors = []
            for e in pipe.events:
                m, p = e.get("method"), e.get("params", {})
                if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                    errors.append("console: " + " ".join(str(a.get("value", a.get("description", "")))
                                                          for a in p.get("args", [])))
                elif m == "Runtime.exceptionThrown":
                    d = p.get("exceptionDetails", {})
                    errors.append(f"exception: {d.get('text', '')} {d.get('exception', {}).get('description', '')}")
                elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                    errors.append(f"log ({p['entry'].get('source')}): {p['entry'].get('text')}")
            return PageCheck(plots=result["plots"], title=result["title"], missing=result["missing"],
                             console_errors=errors, screenshot=shot, tables=result["tables"])
        finally:
            pipe.close()
