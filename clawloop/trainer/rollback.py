"""``clawloop rollback RUN_DIR --to N``: serve an earlier accepted version again.

* With ``url`` (the server running RUN_DIR): ``POST /v1/admin/rollback {"version": N}`` with the admin key; the
  server swaps the weights in at once and its trainer continues from them.
* Without: the version must be kept in ``RUN_DIR/versions``, intact, and not ``uncommitted`` (a crash came between
  its publication and its step's commit); the store's ``rollback_to`` is set, and the next start of the run
  (``clawloop serve --run-dir RUN_DIR``, with or without ``--resume``) serves version N before training.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROLLBACK_META = "rollback_to"
"""Store meta key read by the online trainer at start (``clawloop.trainer.loop``)."""


def rollback_command(run_dir: str | Path, version: int, *, url: str = "", admin_key: str | None = None) -> int:
    run_dir = Path(run_dir)
    if version < 0:
        print("clawloop rollback: --to must be >= 0", file=sys.stderr)
        return 2
    if url:
        return _live(url, version, admin_key if admin_key is not None else os.environ.get("CLAWLOOP_ADMIN_KEY", ""))
    from clawloop.store import Store, find_store
    from clawloop.trainer.versions import has_version, list_versions, version_problem

    try:
        path = find_store(run_dir)
    except FileNotFoundError as exc:
        print(f"clawloop rollback: {exc}", file=sys.stderr)
        return 2
    if not has_version(run_dir, version):
        kept = ", ".join(str(v) for v in list_versions(run_dir)) or "none"
        print(f"clawloop rollback: version {version} is not kept in {run_dir / 'versions'} (kept: {kept})",
              file=sys.stderr)
        return 2
    problem = version_problem(run_dir, version)
    if problem is not None:
        print(f"clawloop rollback: version {version} in {run_dir / 'versions'} is damaged ({problem}) and cannot be "
              "served again", file=sys.stderr)
        return 2
    store = Store(path)
    try:
        if store.version_status(version) == "uncommitted":
            print(f"clawloop rollback: version {version} never committed (a crash came before its step did) and "
                  "cannot be served again", file=sys.stderr)
            return 2
        store.set_meta(ROLLBACK_META, str(int(version)))
    finally:
        store.close()
    print(json.dumps({"run_dir": str(run_dir), "rollback_to": version,
                      "when": "at the next start of this run (no --url was given)"}))
    return 0


def _live(url: str, version: int, admin_key: str) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        r = httpx.post(url.rstrip("/") + "/v1/admin/rollback", json={"version": version}, headers=headers,
                       timeout=600.0)
    except httpx.HTTPError as exc:
        print(f"clawloop rollback: {url} did not answer: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"clawloop rollback: {r.status_code} {r.text}", file=sys.stderr)
        return 1
    print(r.text)
    return 0
