"""The embedded engine and the trainer on a CUDA GPU, with a random model of Qwen3-4B's shape (no download).

What it runs, in one process, and prints as JSON (``--out`` also writes it):

* the model: ``Qwen3ForCausalLM`` with Qwen3-4B's layer shapes (36 layers, hidden 2560, MLP 9728, 32 query and
  8 key/value heads of 128), random weights, saved as bf16 safetensors with the tiny model's tokenizer. The
  vocabulary is the tokenizer's (49,152 ids) instead of Qwen's 151,936, so every sampled id decodes;
* the embedded engine (``HFEngine``, bf16): generation tokens/s at 1 and 16 concurrent requests, and the
  scoring of 8 answers with their top-4;
* the trainer (``Trainer.run_batch``, fp32 master weights as on CPU) on hybrid-method samples of real chat
  prompts, LoRA and full fine-tuning, with teacher scores made up at the asked ids (``benchmarks/synthetic.py``)
  or, for ``lora+teacher``, asked of the served engine: seconds per step, the loss, and the GPU's peak memory.
  ``+support`` adds the teacher-support term with the teacher's top-16 (``support_coef = 1``, ``support_k = 16``).
  The trainer publishes into the same engine, so the hand-over to serving runs too; the publication gate is on
  and checks each step on the GPU.

    python3 benchmarks/cuda_check.py --tokenizer /path/to/tiny-model-folder [--layers 36] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.synthetic import RandomTeacher, write_samples  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True,
                rms_norm_eps=1e-6)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0


def build_model(folder: Path, tokenizer_dir: Path, layers: int, device: str) -> int:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    config = Qwen3Config(vocab_size=len(tokenizer), num_hidden_layers=layers, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **QWEN3_4B)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    params = sum(p.numel() for p in model.parameters())
    del model
    return params


async def engine_rates(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    from clawloop.engines.base import SamplingParams, ScoreRequest

    params = SamplingParams(temperature=0.7, max_tokens=new_tokens, seed=0)
    await engine.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    out = {}
    for concurrency in (1, 16):
        sync()
        t0 = time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(prompts[i % len(prompts)], params)
                                      for i in range(concurrency)))
        sync()
        seconds = time.perf_counter() - t0
        tokens = sum(len(g.token_ids) for g in gens)
        out[f"generate_c{concurrency}_tokens_per_s"] = round(tokens / seconds, 1)
    answers = [list(g.token_ids) for g in gens[:8]]
    t0 = time.perf_counter()
    scored = await engine.score([ScoreRequest(prompt_ids=prompts[i % len(prompts)], response_ids=answers[i],
                                              top_k=4) for i in range(len(answers))])
    sync()
    out["score_8_answers_s"] = round(time.perf_counter() - t0, 3)
    out["score_finite"] = all(bool(torch.isfinite(r.logprobs_T).all()) for r in scored)
    return out


def train(model_dir: Path, engine, lora: bool, samples: int, tokens: int, steps: int, device: str,
          real_teacher: bool = False, support: bool = False) -> dict:
    from clawloop.config import Config
    from clawloop.engines.model_files import load_tokenizer
    from clawloop.store import Store
    from clawloop.trainer.core import Trainer

    tokenizer = load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        config = Config.from_dict(dict(model=str(model_dir), device=device, run_dir=tmp, method="hybrid",
                                       lora=lora, rollout_batch_size=samples, micro_batch_size=samples,
                                       metrics_backends=["jsonl"], gate_every=1,
                                       support_coef=1.0 if support else 0.0, support_k=16 if support else 4))
        store = Store(Path(tmp) / "store.sqlite")
        write_samples(store, tokenizer, samples * steps, tokens)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if real_teacher:  # the served engine scores the hinted prompts, as ``teacher = "policy"`` does
            from clawloop.renderers import chat_render_fn
            from clawloop.teacher import Teacher
            from clawloop.trainer.teacher_client import InProcessTeacher

            teacher = InProcessTeacher(Teacher(engine, chat_render_fn(tokenizer), config))
        else:
            teacher = RandomTeacher(len(tokenizer), config.topk)
        trainer = Trainer(config, store, engine, console=None, teacher=teacher)
        loaded_gib = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        rows = []
        for _ in range(steps):
            lease, leased = store.lease_samples(samples)
            sync()
            t0 = time.perf_counter()
            metrics = trainer.run_batch(lease, leased)
            sync()
            rows.append({"wall_s": round(time.perf_counter() - t0, 2),
                         "step_time_s": round(metrics["step_time_s"], 2), "gate_s": round(metrics.get("gate_s", 0), 2),
                         "loss": round(metrics["loss"], 4), "grad_norm": round(metrics.get("grad_norm", 0.0), 4),
                         "published": metrics["published"], "policy_version": metrics["policy_version"],
                         "teacher_asked": metrics.get("teacher_asked", 0.0),
                         "teacher_wait_s": round(metrics.get("time_teacher_wait_s", 0.0), 2)})
        result = {"variant": ("lora" if lora else "full") + ("+teacher" if real_teacher else "")
                  + ("+support" if support else ""),
                  "samples_per_step": samples, "response_tokens": tokens,
                  "trainable_params": sum(p.numel() for p in trainer.models.trainable_parameters()),
                  "gpu_gib_after_load": round(loaded_gib, 2),
                  "gpu_peak_gib": peak_gib(), "steps": rows}
        trainer.close()
        store.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a local model folder whose tokenizer to use")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--variants", default="lora,full,lora+teacher",
                        help="lora, full; '+teacher' asks the served engine as the teacher instead of made-up scores; "
                        "'+support' adds the teacher-support term at K' = 16")
    parser.add_argument("--out", default="")
    parser.add_argument("--device", default="cuda", help="cpu runs the same code for a quick check of the script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report: dict = {"device": name, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen3-4b-shape"
        t0 = time.perf_counter()
        report["params"] = build_model(model_dir, Path(args.tokenizer), args.layers, args.device)
        report["build_s"] = round(time.perf_counter() - t0, 1)
        from clawloop.engines.hf import HFEngine
        from clawloop.engines.model_files import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about topic {i}."}],
                                                      add_generation_prompt=True)["input_ids"]) for i in range(16)]
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        engine = HFEngine(model_dir, device=args.device, dtype=dtype, max_batch_size=16)
        report["engine"] = asyncio.run(engine_rates(engine, prompts, 128))
        print(json.dumps(report["engine"]), flush=True)
        save(report, args.out)
        report["trainer"] = []
        for variant in args.variants.split(","):
            try:
                report["trainer"].append(train(model_dir, engine, variant.startswith("lora"), args.samples,
                                               args.tokens, args.steps, args.device,
                                               real_teacher="+teacher" in variant,
                                               support="+support" in variant))
            except Exception as exc:  # noqa: BLE001 - report the failure, run the next variant
                report["trainer"].append({"variant": variant, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(report["trainer"][-1]), flush=True)
            save(report, args.out)
        engine.close_sync()
    print(json.dumps(report, indent=2))
    save(report, args.out)
    return 0


def save(report: dict, out: str) -> None:
    """Written after each part, so a run cut short still leaves what it measured."""
    if out:
        Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
