"""Run the default pipeline wiring on a store until no judgeable turn is left (used by the crash test).

    python tests/pipeline_crash_worker.py STORE_PATH JUDGE_URL
"""

import asyncio
import sys

from clawloop.assemble import build_pipeline
from clawloop.config import Config
from clawloop.engines.hf import HFEngine
from clawloop.store import Store


async def main(store_path: str, judge_url: str) -> None:
    config = Config(model="tiny", judge_url=judge_url, judge_model="m", prm_m=2, judge_timeout_s=10,
                    judge_retries=1, num_threads=1, max_batch_size=4)
    store = Store(store_path)
    policy = HFEngine("tiny", device="cpu", num_threads=1, max_batch_size=4)
    pipeline = build_pipeline(config, store, tokenizer=policy.tokenizer, concurrency=2, poll_interval_s=0.2)
    recovered = await pipeline.start()
    print(f"started {recovered}", flush=True)
    drained = await pipeline.drain(timeout_s=300)
    await pipeline.stop()
    await policy.close()
    print(f"drained={drained} stats={dict(pipeline.stats)}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
