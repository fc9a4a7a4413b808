"""The web console in a real headless Chromium (Debian's `chromium` and `chromium-driver`,
through selenium), against a real server with a real agent running namespace sandboxes.

Skipped, saying so, only where Chromium or its driver is not installed (scripts/setup installs
both, so CI runs it). Screenshots of the pages it visits are left in the test's tmp_path, and
copied to the folder FLEET_CONSOLE_SHOTS names when it is set (to look at them afterwards)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleet.api.pb import fleet_pb2_grpc
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import harness, namespace_runtime, request

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.sandbox,
    pytest.mark.skipif(
        CHROMIUM is None or DRIVER is None,
        reason="needs Debian's chromium and chromium-driver (scripts/setup installs them)",
    ),
]
BAD_SMOLFILE = 'image = "minimal"\n[network]\nallow_cidrs = ["169.254.169.254/32"]\n'


def _browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # The server's certificate chains to the test's own throwaway CA, which Chromium does
    # not know: its errors are ignored in this browser only.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--ignore-certificate-errors"):  # fmt: skip
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(str(DRIVER)), options=options)


def _shot(browser: Any, tmp_path: Path, name: str) -> Path:
    """A screenshot of the page in tmp_path (and in $FLEET_CONSOLE_SHOTS, when set)."""
    path = tmp_path / f"{name}.png"
    assert browser.save_screenshot(str(path)), f"no screenshot of {name}"
    if folder := os.environ.get("FLEET_CONSOLE_SHOTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(folder) / path.name)
    return path


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Waits, off the event loop, until `check` holds (checked every 0.1 s)."""
    for _ in range(int(timeout_s / 0.1)):
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


async def test_the_console_in_a_real_browser(tmp_path: Path, images: ImageStore) -> None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    async with harness(tmp_path, images, secure=True, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        port = await h.server.start_console("127.0.0.1:0")
        base = f"https://127.0.0.1:{port}"  # (TLS: the server's, from a throwaway CA)
        tenant, admin = h.key("default"), h.key("ops", "admin")
        browser = await asyncio.to_thread(_browser)
        try:

            def sign_in(key: str) -> None:
                browser.delete_all_cookies()
                browser.get(f"{base}/login")
                browser.find_element(By.ID, "key").send_keys(key)
                browser.find_element(By.ID, "sign-in").click()
                # (a click returns before the navigation it starts has ended)
                _wait(lambda: not browser.current_url.endswith("/login"), "signed in")

            def text(element_id: str) -> str:
                """The element's text; "" while the page (or its live part) is being
                replaced under it."""
                try:
                    return str(browser.find_element(By.ID, element_id).text)
                except (NoSuchElementException, StaleElementReferenceException):
                    return ""

            def rules() -> list[str]:
                try:
                    return [e.text for e in browser.find_elements(By.CSS_SELECTOR, "td.rule")]
                except StaleElementReferenceException:
                    return []

            def click(by: str, value: str) -> None:
                browser.find_element(by, value).click()

            def browse(rid: str) -> None:
                browser.get(f"{base}/rollouts/{rid}")
                first = text("rollout-state")
                _wait(lambda: text("rollout-state") == "SUCCEEDED", "SUCCEEDED on the page")
                assert first in ("QUEUED", "RUNNING")  # (so it changed on the open page)
                assert "done" in text("stdout-0")
                _shot(browser, tmp_path, "rollout")
                # Its output, downloaded by the browser with its session.
                link = browser.find_element(By.CSS_SELECTOR, "a.output").get_attribute("href")
                got = browser.execute_async_script(
                    "const done = arguments[arguments.length - 1];"
                    "fetch(arguments[0]).then(r => r.text()).then(done);", link)  # fmt: skip
                assert got == "hello from the machine\n"
                browser.get(f"{base}/rollouts")
                assert rid in browser.page_source
                _shot(browser, tmp_path, "rollouts")
                # A bad Smolfile's finding on the policy page.
                browser.get(f"{base}/policy")
                browser.find_element(By.ID, "smolfile").send_keys(BAD_SMOLFILE)
                click(By.ID, "audit")
                _wait(lambda: "FLEET005" in rules(), "the audit's finding on the page")
                _shot(browser, tmp_path, "policy")
                # A session opened from its page; a command run in its exec box, whose output
                # the page follows (the command is still running when the page loads).
                browser.get(f"{base}/sessions")
                click(By.ID, "open")
                _wait(lambda: text("session-state") == "OPEN", "the opened session's page")
                assert browser.current_url.startswith(f"{base}/sessions/")
                browser.find_element(By.ID, "command").send_keys(
                    "sleep 2; echo '<b>hello</b> from the session'"
                )
                click(By.ID, "run")
                _wait(lambda: text("exec-status") == "exit 0", "the command's exit on the page")
                assert text("exec-output") == "<b>hello</b> from the session"
                _shot(browser, tmp_path, "session")
                # Cordoning: refused to the tenant, done by the admin after confirming.
                browser.get(f"{base}/hosts/cpu-a/cordon")
                assert "needs an admin key" in text("error")
                sign_in(admin)
                browser.get(f"{base}/hosts/cpu-a/cordon")
                click(By.ID, "confirm")
                _wait(lambda: browser.current_url == f"{base}/hosts", "back on the hosts page")
                state = browser.find_element(By.CSS_SELECTOR, "#host-cpu-a .host-state").text
                assert state == "cordoned"
                _shot(browser, tmp_path, "hosts")
                # The cost report of the rollout that ran, with its chart drawn by the server.
                browser.get(f"{base}/cost")
                assert browser.find_elements(By.CSS_SELECTOR, "#cost tr.group")
                assert browser.find_elements(By.CSS_SELECTOR, "svg#cost-chart rect.bar")
                _shot(browser, tmp_path, "cost")

            await asyncio.to_thread(sign_in, tenant)
            assert await asyncio.to_thread(lambda: browser.current_url) == f"{base}/rollouts"
            # Submitted through the client; watched on its page until it succeeds, live.
            async with h.connect(tenant) as channel:
                stub = fleet_pb2_grpc.FleetServiceStub(channel)
                step = "sleep 3; mkdir -p /out; echo hello from the machine > /out/result.txt"
                req = request('image = "minimal"\n', ["sh", "-c", step + "; echo done"])
                req.labels["suite"] = "console"
                req.outputs.append("/out/result.txt")
                rid = (await stub.SubmitRollout(req)).rollout.id
            # Everything the browser does from here runs off the event loop that serves its
            # pages: a webdriver call waits for a page load, which needs this loop.
            await asyncio.to_thread(browse, rid)
            assert h.server.core.ledger.host_states()["cpu-a"] == "cordoned"
        finally:
            await asyncio.to_thread(browser.quit)
