"""The chat page in real headless Chromium against a real server: streaming, Stop, settings."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists() and shutil.which("chromium") is None,
                                reason="Chromium is not installed (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        path = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
        b = p.chromium.launch(executable_path=path, args=ARGS)
        yield b
        b.close()


def wait_for(condition, timeout: float):
    """Poll from Python: the page's CSP forbids the eval that page.wait_for_function needs."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


def test_chat_streams_stops_and_keeps_settings(browser, web_server):
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(web_server.http + "/")
    page.wait_for_selector("#conn[data-state=ready]", timeout=30_000)
    assert "SmolLM2-135M-Instruct" in page.text_content("#model")

    # settings: saved to localStorage as they change
    page.fill("#max-tokens", "300")
    page.fill("#system-prompt", "You are a storyteller.")
    page.locator("#temperature").fill("0")
    page.dispatch_event("#max-tokens", "change")

    baseline = web_server.wait_blocks(0)["num_used_blocks"]
    page.fill("#prompt", "Tell me a long story about a brave <b>dragon</b>.")
    page.press("#prompt", "Enter")
    assistant = page.locator(".msg.assistant .body").last
    first = wait_for(lambda: assistant.text_content(), 60)
    wait_for(lambda: len(assistant.text_content()) > len(first), 60)  # more text keeps arriving: it streams
    assert page.text_content("#stat-ttft").endswith("ms")
    assert page.is_enabled("#stop")

    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-status=cancelled]", timeout=30_000)
    assert page.is_disabled("#stop") and page.is_enabled("#send")
    tokens = int(page.text_content("#stat-tokens"))
    assert 2 <= tokens < 300
    assert page.text_content("#stat-cached") == "0"
    assert web_server.wait_blocks(baseline)["num_used_blocks"] == baseline  # Stop freed the KV blocks
    # user text is shown as text, never parsed as HTML
    assert page.locator(".msg b").count() == 0
    assert "<b>dragon</b>" in page.locator(".msg.user .body").last.text_content()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "web_chat.png"), full_page=True)

    page.reload()
    page.wait_for_selector("#conn[data-state=ready]", timeout=30_000)
    assert page.input_value("#max-tokens") == "300"
    assert page.input_value("#system-prompt") == "You are a storyteller."
    assert float(page.input_value("#temperature")) == 0.0
    saved = page.evaluate("JSON.parse(localStorage.getItem('specserve.settings'))")
    assert saved["maxTokens"] == 300 and saved["temperature"] == 0
    assert problems == []
    page.close()
