"""Merging a ``torchrun`` trainer's LoRA adapter folder for the embedded engine: straight from the base model's
files (``merge_adapter_folder``) next to peft's merge on a freshly loaded base model (what the API did before),
on the default model, side by side in one run.

The adapter is the demo's (r 16, alpha 32, every attention and MLP projection) with random B, written once.
Each round times both ways (alternating, so machine noise hits both) and checks they agree to 1e-6.

    .venv/bin/python benchmarks/publish_lora.py            # 5 rounds, 1 thread
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="default, tiny, or a model folder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model

    from clawloop.engines.model_files import load_model, resolve_model
    from clawloop.trainer.publish import merge_adapter_folder, merge_adapter_with_peft

    torch.set_num_threads(args.threads)
    base_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = Path(tmp) / "adapter"
        policy = get_peft_model(load_model(base_dir, device="cpu"), LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]))
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.01)
        policy.save_pretrained(str(adapter_dir))
        del policy
        times: dict[str, list[float]] = {"direct": [], "peft": []}
        for r in range(args.rounds):
            t0 = time.perf_counter()
            direct = merge_adapter_folder(adapter_dir, base_dir)
            times["direct"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            by_peft = merge_adapter_with_peft(adapter_dir, base_dir)
            times["peft"].append(time.perf_counter() - t0)
            worst = max(float((direct[k] - v).abs().max()) for k, v in by_peft.items())
            print(f"round {r + 1}: direct {times['direct'][-1]:.2f} s, peft {times['peft'][-1]:.2f} s, "
                  f"max |difference| {worst:.1e}")
            assert worst <= 1e-6 and set(direct) == set(by_peft)
            del direct, by_peft
    d, p = statistics.median(times["direct"]), statistics.median(times["peft"])
    print(f"\n{base_dir.name}, {args.threads} thread(s), median of {args.rounds}: direct {d:.2f} s, peft {p:.2f} s, "
          f"peft / direct = {p / d:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
