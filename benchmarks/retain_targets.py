"""The retain term's targets built with nothing kept (a new machine) and again from the starting weights' answers
kept by that first build (every later run and restart on the machine), side by side in one process.

Both builds use the trainer's own code (``clawloop.trainer.core.starting_retain_examples``) on the demo preset's
model and settings (SmolLM2-135M-Instruct, ``retain_tokens`` 64, ``retain_k`` 16, all 50 prompts). The kept
answers go to a temporary folder, never the machine's cache. The first build decodes every prompt's greedy answer,
one forward pass per answer token; the second reads the answers and runs one forward over each prompt and answer.
It prints both times, their ratio, and how far the second build's targets are from the first's (the same ids and
trained positions; log-probs within float rounding).

    .venv/bin/python benchmarks/retain_targets.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from clawloop.gate import kept_answers  # noqa: E402
from clawloop.sim.demo import demo_config  # noqa: E402
from clawloop.trainer.core import starting_retain_examples  # noqa: E402
from clawloop.trainer.model import load_train_models  # noqa: E402
from clawloop.trainer.retain_prompts import RETAIN_PROMPTS  # noqa: E402


def build(models, config) -> tuple[list, float]:
    models.gate_kept_answers = None  # opened afresh from the file, as a new run opens it
    t0 = time.perf_counter()
    examples = starting_retain_examples(models, config, list(RETAIN_PROMPTS))
    return examples, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="model folder (default: the demo's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="clawloop-retain-") as tmp:
        kept_answers.answers_root = lambda: Path(tmp) / "gate-answers"
        settings = {"num_threads": args.threads, "device": "cpu", "run_dir": str(Path(tmp) / "run"),
                    "metrics_backends": []}
        if args.model:
            settings["model"] = args.model
        config = demo_config(settings)
        models = load_train_models(config)
        model_name = Path(models.model_dir).name
        cold, cold_s = build(models, config)
        warm, warm_s = build(models, config)
    pairs = [(a, b) for a, b in zip(cold, warm) if a is not None or b is not None]
    same = all(a is not None and b is not None and torch.equal(a.input_ids_L, b.input_ids_L)
               and torch.equal(a.positions_T, b.positions_T) and torch.equal(a.ref_ids_T_K, b.ref_ids_T_K)
               for a, b in pairs)
    drift = max(float((a.ref_logprobs_T_K - b.ref_logprobs_T_K).abs().max()) for a, b in pairs if a and b)
    tokens = sum(int(e.ref_ids_T_K.shape[0]) for e in cold if e is not None)
    print(f"retain targets of {len(RETAIN_PROMPTS)} prompts ({tokens} answer tokens), {model_name}, "
          f"{args.threads} threads")
    print(f"  nothing kept (decoded):      {cold_s:6.1f} s")
    print(f"  answers kept (one forward):  {warm_s:6.1f} s   ({cold_s / warm_s:.1f}x faster)")
    print(f"  same answers, positions and top-k ids: {same}; largest log-prob difference {drift:.2e}")


if __name__ == "__main__":
    main()
