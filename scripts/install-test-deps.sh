#!/usr/bin/env bash
# Test-only system dependency: Debian's headless Chromium for the viewer test.
# Installs it only when missing (needs root, as on the project's machines).
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  echo "installing Debian chromium for the browser test ..."
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
