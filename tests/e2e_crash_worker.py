"""Serve + judge + train on a run folder until told to stop (used by the kill -9 test).

    python tests/e2e_crash_worker.py RUN_DIR JUDGE_URL PORT_FILE [--resume]

Writes the server's base URL to PORT_FILE once it accepts requests, then serves until RUN_DIR/stop exists.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from e2e_support import build_server, e2e_config  # noqa: E402


def main(run_dir: str, judge_url: str, port_file: str, resume: bool) -> None:
    torch.set_num_threads(1)
    config = e2e_config(run_dir, judge_url, num_threads=1, steps_per_batch=2)
    server, _, trainer = build_server(config, resume=resume)
    server.start()
    Path(port_file).write_text(server.base_url)
    print(f"serving {server.base_url} resumed={trainer.resumed}", flush=True)
    stop = Path(run_dir) / "stop"
    while not stop.exists():
        time.sleep(0.05)
    server.stop(timeout_s=120)
    print(f"stopped step={trainer.step} version={trainer.policy_version}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--resume" in sys.argv[4:])
