"""Serving many LoRA adapters from one base model in one batch, against one model with its adapter merged.

One process loads SmolLM2-135M-Instruct (the default model) twice: once with a random rank-16 adapter merged
into its weights (what a shared policy serves), once with adapter slots (``clawloop.engines.multi_lora``) holding
16 random rank-16 adapters of the same shape as the trainer's (all seven projections). A batch of ``--rows``
prompts is prefilled and decoded greedily for ``--tokens`` steps with a KV cache, the rows spread over 1, 4 or 16
distinct adapters; each variant runs ``--repeats`` times, interleaved, and the best time counts. Each line
prints generated tokens/s and the ratio to the merged model; the first line also checks that a row served from
the slots computes the same logits as the merged model (the largest difference).

The last lines do the same through the embedded engine (``clawloop.engines.hf.HFEngine``, continuous batching):
``--rows`` concurrent greedy requests of ``--tokens`` tokens each (end-of-turn off, so every answer has that
length), on an engine serving the merged model and on one with ``adapter_slots = 16`` whose requests name 1, 4 or
16 distinct published adapters.

    .venv/bin/python benchmarks/multi_lora.py                 # 16 rows x 32 tokens, 2 threads
    .venv/bin/python benchmarks/multi_lora.py --rows 4 --threads 1 --no-engine
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="Requests decoded together.")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="Decoding steps.")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-engine", dest="engine", action="store_false", help="Skip the embedded engine's lines.")
    args = parser.parse_args()

    import torch

    from clawloop.engines.model_files import default_model_dir, load_model
    from clawloop.engines.multi_lora import LORA_TARGETS, PEFT_PREFIX, MultiLoRA

    torch.set_num_threads(args.threads)
    base = load_model(default_model_dir(), device="cpu").eval()
    adapters = [random_adapter(base, args.rank, seed, PEFT_PREFIX) for seed in range(16)]
    scaling = 2.0
    merged_model = merge(base, adapters[0], scaling, PEFT_PREFIX)
    slots = MultiLoRA(copy.deepcopy(base), LORA_TARGETS, max_adapters=16, max_rank=args.rank)
    for i, adapter in enumerate(adapters):
        slots.load(f"user{i}", adapter, scaling)
    torch.manual_seed(0)
    prompt_B_L = torch.randint(100, 30000, (args.rows, args.prompt_tokens))

    with torch.inference_mode():
        with slots.rows(["user0"] * args.rows):
            ours = slots.model(input_ids=prompt_B_L[:1]).logits
        diff = float((ours - merged_model(input_ids=prompt_B_L[:1]).logits).abs().max())

    variants = {"merged model, one adapter": (merged_model, None)}
    for distinct in sorted({min(d, args.rows) for d in (1, 4, 16)}):
        names = [f"user{b % distinct}" for b in range(args.rows)]
        variants[f"adapter slots, {distinct} distinct adapter{'s' if distinct > 1 else ''}"] = (slots.model, names)
    best = {name: float("inf") for name in variants}
    for _ in range(args.repeats):
        for name, (model, rows) in variants.items():
            if rows is None:
                seconds = decode(model, prompt_B_L, args.tokens)
            else:
                with slots.rows(rows):
                    seconds = decode(model, prompt_B_L, args.tokens)
            best[name] = min(best[name], seconds)
    print(f"multi-adapter serving: SmolLM2-135M-Instruct, {args.rows} rows x {args.prompt_tokens} prompt + "
          f"{args.tokens} generated tokens, rank {args.rank} on {len(LORA_TARGETS)} projections, {args.threads} "
          f"thread(s), best of {args.repeats}; a slot row vs the merged model: max |logit diff| {diff:.1e}")
    reference = best["merged model, one adapter"]
    for name, seconds in best.items():
        print(f"{name}: {args.rows * args.tokens / seconds:.1f} tokens/s ({seconds:.2f}s) | "
              f"ratio to merged {reference / seconds:.2f}")
    if args.engine:
        del slots
        engine_lines(base, merged_model, adapters, scaling, prompt_B_L.tolist(), args)


def engine_lines(base, merged_model, adapters, scaling: float, prompts: list[list[int]], args) -> None:
    """The same comparison through the embedded engine: concurrent requests, continuous batching."""
    import asyncio

    from clawloop.engines.base import SamplingParams
    from clawloop.engines.hf import HFEngine
    from clawloop.engines.model_files import default_model_dir, load_tokenizer

    tokenizer = load_tokenizer(default_model_dir())
    common = dict(max_batch_size=args.rows, eos_token_ids=[], num_threads=args.threads)
    plain = HFEngine(merged_model, tokenizer, **common)
    slotted = HFEngine(copy.deepcopy(base), tokenizer, adapter_slots=16, adapter_rank=args.rank, **common)
    for i, adapter in enumerate(adapters):
        slotted.publish_adapter_sync(f"user{i}", adapter, scaling)

    async def answer_all(engine, names) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                                 adapter=n)) for p, n in zip(prompts, names)])
        return time.perf_counter() - t0

    variants = {"engine, merged model": (plain, [None] * args.rows)}
    for distinct in sorted({min(d, args.rows) for d in (1, 4, 16)}):
        variants[f"engine, {distinct} distinct adapter{'s' if distinct > 1 else ''}"] = (
            slotted, [f"user{b % distinct}" for b in range(args.rows)])
    best = {name: float("inf") for name in variants}
    for _ in range(args.repeats):
        for name, (engine, names) in variants.items():
            best[name] = min(best[name], asyncio.run(answer_all(engine, names)))
    reference = best["engine, merged model"]
    for name, seconds in best.items():
        print(f"{name}: {args.rows * args.tokens / seconds:.1f} tokens/s ({seconds:.2f}s) | "
              f"ratio to merged {reference / seconds:.2f}")
    plain.close_sync()
    slotted.close_sync()


def decode(model, prompt_B_L, steps: int) -> float:
    """Seconds to prefill the batch and decode ``steps`` greedy tokens with a KV cache."""
    import torch
    from transformers import DynamicCache

    from clawloop.engines.hf import cache_kwargs

    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=prompt_B_L, logits_to_keep=1, **cache_kwargs(model, cache))
        for _ in range(steps - 1):
            next_B_1 = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=next_B_1, **cache_kwargs(model, cache))
    return time.perf_counter() - t0


def random_adapter(model, rank: int, seed: int, prefix: str):
    import torch

    from clawloop.engines.multi_lora import LORA_TARGETS

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in LORA_TARGETS:
            out_f, in_f = module.weight.shape
            out[f"{prefix}{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
            out[f"{prefix}{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    return out


def merge(model, adapter, scaling: float, prefix: str):
    import torch

    merged = copy.deepcopy(model)
    with torch.no_grad():
        for key, a in adapter.items():
            if key.endswith(".lora_A.weight"):
                b = adapter[key.replace("lora_A", "lora_B")]
                merged.get_submodule(key[len(prefix):-len(".lora_A.weight")]).weight += scaling * (b @ a)
    return merged


if __name__ == "__main__":
    main()
