#!/usr/bin/env bash
# Makes sure a Chromium is there for the dashboard's browser tests and screenshots (Playwright drives the system
# browser through executable_path; its own browser downloads are never used). Idempotent: returns at once when
# a Chromium is on PATH or CLAWLOOP_CHROMIUM names one. On Debian/Ubuntu it installs the distribution's `chromium`
# package with apt-get (as root, or through sudo when that needs no password). Where it cannot, it says why and
# exits 0: the browser tests then skip with that reason instead of failing the build.
set -euo pipefail
if [ -n "${CLAWLOOP_CHROMIUM:-}" ] && [ -x "$CLAWLOOP_CHROMIUM" ]; then exit 0; fi
for name in chromium chromium-browser google-chrome google-chrome-stable; do
  if command -v "$name" >/dev/null; then exit 0; fi
done
if ! command -v apt-get >/dev/null; then
  echo "setup_chromium: no Chromium and no apt-get here; install Chromium and set CLAWLOOP_CHROMIUM (browser tests will skip)" >&2
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
  echo "setup_chromium: not root and no password-less sudo; run 'apt-get install -y chromium' as root (browser tests will skip)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; then
  $SUDO apt-get update -qq >/dev/null && $SUDO apt-get install -y --no-install-recommends chromium >/dev/null \
    || { echo "setup_chromium: apt-get could not install chromium (browser tests will skip)" >&2; exit 0; }
fi
chromium --version
