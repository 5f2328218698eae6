"""A torchrun worker for the lost-lease test: the distributed trainer on a local store that loses the lease while
the step runs (as when it expires and the batch goes back), so rank 0's commit is refused.

    torchrun --nproc_per_node 2 tests/trainer/lost_lease_worker.py STORE MODEL_DIR RUN_DIR
"""

import os
import sys
from typing import Any

import torch

from clawloop.config import Config
from clawloop.store import Store
from clawloop.trainer import distributed


class LeaseLostDuringStep(Store):
    def commit_step(self, lease_id: str, *args: Any, **kwargs: Any) -> None:
        self.release_lease(lease_id)  # the lease expired while the step ran: its samples went back to ready
        super().commit_step(lease_id, *args, **kwargs)


def main(store_file: str, model_dir: str, run_dir: str) -> None:
    torch.set_num_threads(1)
    config = Config.load(env={}, cli=dict(model=model_dir, device="cpu", run_dir=run_dir, num_threads=1,
                                          rollout_batch_size=5, lr=1e-2, gate=False))
    store = LeaseLostDuringStep(store_file) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        trained = distributed.run(config, store, max_steps=2, poll_s=0.1, report_weights=False)
        print(f"rank {os.environ.get('RANK')} trained {trained}", flush=True)
        distributed.leave_together()
    finally:
        if store is not None:
            store.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    distributed.exit_now(0)  # as the trainer's own entry point leaves
