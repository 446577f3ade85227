"""One way to start the real headless Chromium the browser tests drive (Debian's
chromium and chromium-driver, through selenium), with the flags this machine needs:
without the background-networking ones Chromium keeps dialling hosts the closed
network refuses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@contextmanager
def chromium(profile: Path, window: str = "1440,900", console_log: bool = False
             ) -> Iterator[Any]:
    """A headless Chromium with its own empty profile; quit on exit."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.fail("the browser test needs Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never download anything
    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                     f"--window-size={window}"):
        options.add_argument(argument)
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
