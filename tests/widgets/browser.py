"""The one place that starts JupyterLab and drives Chromium for the real-browser tests.

``lab_page(root_dir)`` is a context manager that:

1. starts JupyterLab on ``127.0.0.1`` with ``--port=0``, so the server takes whatever port the
   kernel gives it, and reads the port back from the server's own runtime file
   (``jpserver-<pid>.json`` in a private runtime folder). Nothing here picks a port and closes it
   again for someone else to take;
2. waits for readiness by polling the server's REST API (``/api/status``) until it answers, while
   watching the process: a server that exits early fails at once with its log;
3. launches Debian's Chromium (``/usr/bin/chromium``) through the Playwright pip package, headless,
   and yields a ``LabPage`` (the Playwright page plus helpers to open and run a notebook);
4. tears everything down at the end: browser, server, kernels, temporary folders.

Where the browser cannot start (no Chromium, no Playwright, a sandbox that forbids it) the test is
skipped with a message that says what is missing; every other failure is a failure.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional

import nbformat
import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("NBSCALER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--no-first-run", "--disable-dev-shm-usage"]
SERVER_START_S = 90.0

# JupyterLab settings for a quiet, reproducible page: no news or update toasts over the widgets.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def write_notebook(path: Path, *sources: str) -> Path:
    """A notebook of code cells with the ``python3`` kernel named, so JupyterLab asks nothing."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, path)
    return path


@dataclass
class LabServer:
    """A running JupyterLab: where it listens and how to authenticate."""

    process: subprocess.Popen
    port: int
    token: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{sep}token={self.token}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def _write_lab_settings(settings_dir: Path) -> None:
    for rel, values in LAB_SETTINGS.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


def _server_port(runtime_dir: Path, pid: int) -> Optional[int]:
    """The port the server with ``pid`` listens on, from its runtime file, once it has written it."""
    info = runtime_dir / f"jpserver-{pid}.json"
    try:
        return int(json.loads(info.read_text())["port"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None       # not written yet, or caught mid-write


def _api_ready(server: LabServer) -> bool:
    try:
        with urllib.request.urlopen(server.url("api/status"), timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _poll(condition, what: str, deadline: float, process: subprocess.Popen, log_path: Path, every_s: float = 0.1):
    """Call ``condition()`` until it returns something truthy; fail with the server log if the server
    exits or ``deadline`` passes."""
    while True:
        value = condition()
        if value:
            return value
        if process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {process.returncode} before {what}:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"JupyterLab: no {what} within {SERVER_START_S:.0f} s:\n"
                               f"{log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(every_s)


@contextlib.contextmanager
def jupyter_lab(root_dir: Path, env: Optional[Dict[str, str]] = None) -> Iterator[LabServer]:
    """Run JupyterLab serving ``root_dir``; its kernels import this checkout of nbscaler."""
    with tempfile.TemporaryDirectory(prefix="nbscaler-lab-") as tmp:
        tmp_path = Path(tmp)
        runtime_dir, settings_dir = tmp_path / "runtime", tmp_path / "settings"
        _write_lab_settings(settings_dir)
        token = secrets.token_hex(16)
        server_env = {**os.environ, **(env or {}),
                      "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                      "JUPYTER_RUNTIME_DIR": str(runtime_dir), "JUPYTERLAB_SETTINGS_DIR": str(settings_dir),
                      "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
        log_path = tmp_path / "server.log"
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
               "--ServerApp.open_browser=False", "--ServerApp.allow_root=True", "--LabApp.news_url=",
               "--ServerApp.terminals_enabled=False"]
        with open(log_path, "w") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env,
                                       start_new_session=True)
        try:
            deadline = time.monotonic() + SERVER_START_S
            port = _poll(lambda: _server_port(runtime_dir, process.pid), "runtime file", deadline, process, log_path)
            server = LabServer(process, port, token, log_path)
            _poll(lambda: _api_ready(server), "answer from /api/status", deadline, process, log_path)
            yield server
        finally:
            _stop_server(process)


def _stop_server(process: subprocess.Popen) -> None:
    """Stop the server and every process under it: kernels run in sessions of their own, so they are
    collected by ancestry before the server goes, and killed if its shutdown left them behind."""
    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if process.poll() is None:
        process.terminate()                          # the server shuts its kernels down on SIGTERM
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    for child in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(family, timeout=10)


@contextlib.contextmanager
def chromium(viewport=(1600, 2400)):
    """A headless Chromium page driven by Playwright; skips the test where the browser cannot start."""
    try:
        from playwright.sync_api import Error as PlaywrightError, sync_playwright
    except ImportError:
        pytest.skip("the browser test needs the Playwright pip package: pip install playwright")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"the browser test needs Chromium at {CHROMIUM} (apt-get install chromium), "
                    "or NBSCALER_CHROMIUM=/path/to/chrome")
    with sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        except PlaywrightError as e:
            pytest.skip(f"Chromium at {CHROMIUM} did not start under Playwright: {str(e).splitlines()[0]}")
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()


class LabPage:
    """A JupyterLab page in Chromium, with the few moves the browser tests make."""

    def __init__(self, page, server: LabServer, screenshots: Path):
        self.page, self.server, self.screenshots = page, server, screenshots
        self.console = []
        page.on("console", lambda msg: self.console.append(f"{msg.type}: {msg.text}"))

    def open_notebook(self, name: str, timeout_s: float = 90) -> None:
        """Open ``name`` and wait until its kernel has started and is idle."""
        self.page.goto(self.server.url(f"lab/tree/{name}?reset"), timeout=timeout_s * 1000)
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=timeout_s * 1000)
        self.wait_until_idle(timeout_s)

    def wait_until_idle(self, timeout_s: float = 90) -> None:
        """Wait until the status bar says the kernel is idle."""
        self.page.get_by_text(re.compile(r"\|\s*Idle$")).first.wait_for(timeout=timeout_s * 1000)

    def run_all_cells(self) -> None:
        """Run every cell, as the menu's Run > Run All Cells does."""
        self.page.click(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor")
        self.page.keyboard.press("Escape")                   # command mode
        for _ in self.page.query_selector_all(".jp-NotebookPanel .jp-Cell"):
            self.page.keyboard.press("Shift+Enter")

    def screenshot(self, name: str, selector: Optional[str] = None) -> Path:
        """Save a PNG of the page (or of one element) and check it is not blank."""
        return screenshot(self.page, self.screenshots / f"{name}.png", selector)


def screenshot(page, path: Path, selector: Optional[str] = None, full_page: bool = False) -> Path:
    """Save a PNG of ``page`` (or of one element) at ``path`` and check it is not blank."""
    target = page.locator(selector).first if selector else page
    png = target.screenshot(path=str(path), **({"full_page": True} if full_page and not selector else {}))
    stats = image_stats(page, png)
    assert stats["colours"] >= 8 and stats["non_background"] > 0.01, f"screenshot {path} looks blank: {stats}"
    return path


def image_stats(page, png: bytes) -> Dict[str, float]:
    """Distinct colours and the share of pixels unlike the top-left one, decoded by the browser."""
    return page.evaluate("""async (data) => {
        const img = new Image();
        img.src = 'data:image/png;base64,' + data;
        await img.decode();
        const canvas = document.createElement('canvas');
        canvas.width = img.width; canvas.height = img.height;
        const ctx = canvas.getContext('2d');
        ctx.drawImage(img, 0, 0);
        const px = ctx.getImageData(0, 0, img.width, img.height).data;
        const colours = new Set();
        let other = 0;
        for (let i = 0; i < px.length; i += 4) {
            colours.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
            if (px[i] !== px[0] || px[i + 1] !== px[1] || px[i + 2] !== px[2]) other++;
        }
        return {colours: colours.size, non_background: other / (px.length / 4)};
    }""", base64.b64encode(png).decode())


@contextlib.contextmanager
def lab_page(root_dir: Path, screenshots: Path) -> Iterator[LabPage]:
    """JupyterLab serving ``root_dir`` and a Chromium page on it; screenshots go to ``screenshots``."""
    screenshots.mkdir(parents=True, exist_ok=True)
    with chromium() as page, jupyter_lab(root_dir) as server:
        yield LabPage(page, server, screenshots)
