"""Serving speed: the embedded engine against calling HF ``model.generate`` directly, and the API's overhead.

Part 1, generation throughput. The same model object, the same prompts, greedy decoding and exactly
``--new-tokens`` tokens per request on both sides (EOS is ignored on both, so the work is identical):

* ``engine``: ``HFEngine.generate`` with ``c`` requests in flight at once (continuous batching);
* ``HF generate, batched``: one ``model.generate`` call on the ``c`` prompts left-padded into one batch
  (the best case for HF: every request known up front, same length out);
* ``HF generate, one by one``: ``c`` calls of ``model.generate``, as a server without batching would do.

Tokens/s = generated tokens / wall time, best of ``--repeats`` alternating runs. Also checks that the engine's
greedy tokens equal HF's, and reports the share of the engine's decode time spent in the model's forward.

Part 2, API overhead (needs ``clawloop.api.app``; printed as skipped otherwise): the same chat request sent
``--api-requests`` times, one after another, over HTTP to a live ``clawloop serve`` app sharing the engine,
against ``engine.generate`` on the very prompt ids the API renders, alternating. The median difference
within pairs is what the API adds per request (parsing, rendering, session and turn bookkeeping, the SQLite
commit, HTTP); on a busy machine it also carries the noise of the generation itself.

    .venv/bin/python benchmarks/serving.py                      # default model (SmolLM2-135M-Instruct)
    .venv/bin/python benchmarks/serving.py --model tiny         # a few seconds
    .venv/bin/python benchmarks/serving.py --new-tokens 64 --concurrency 1 8 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from clawloop.engines import model_files  # noqa: E402
from clawloop.engines.base import SamplingParams  # noqa: E402
from clawloop.engines.hf import HFEngine  # noqa: E402
from benchmarks.prompts import QUESTIONS, chat_prompt  # noqa: E402


def hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One ``model.generate`` call on left-padded prompts; exactly ``new_tokens`` greedy tokens each."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    return out[:, width:].tolist()


async def engine_generate(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    results = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return [g.token_ids for g in results]


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


def throughput(model, tokenizer, engine, concurrency: list[int], new_tokens: int, repeats: int) -> None:
    prompts_all = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    # Warm-up (first calls allocate and pick kernels).
    hf_generate(model, tokenizer, prompts_all[:2], 4)
    asyncio.run(engine_generate(engine, prompts_all[:2], 4))

    print(f"\n== generation throughput: greedy, {new_tokens} new tokens per request, best of {repeats} ==")
    header = f"{'concurrency':>11} | {'engine tok/s':>12} | {'HF batched tok/s':>16} | {'HF one-by-one tok/s':>19} | " \
             f"{'engine/HF batched':>17} | {'engine/HF one-by-one':>20} | {'forward share':>13} | same tokens"
    print(header)
    print("-" * len(header))
    for c in concurrency:
        prompts = [prompts_all[i % len(prompts_all)] for i in range(c)]
        total = c * new_tokens
        best = {"engine": float("inf"), "batched": float("inf"), "serial": float("inf")}
        fwd0, step0 = engine.stats["decode_forward_s"], engine.stats["decode_total_s"]
        for _ in range(repeats):  # the sides alternate, so a change in machine load hits both
            eng_ids, s = timed(lambda: asyncio.run(engine_generate(engine, prompts, new_tokens)))
            best["engine"] = min(best["engine"], s)
            batched_ids, s = timed(lambda: hf_generate(model, tokenizer, prompts, new_tokens))
            best["batched"] = min(best["batched"], s)
            if c == 1:
                serial_ids = batched_ids
                best["serial"] = best["batched"]
            else:
                serial_ids, s = timed(lambda: [hf_generate(model, tokenizer, [p], new_tokens)[0] for p in prompts])
                best["serial"] = min(best["serial"], s)
        forward_share = (engine.stats["decode_forward_s"] - fwd0) / max(1e-9, engine.stats["decode_total_s"] - step0)
        assert all(len(ids) == new_tokens for ids in eng_ids)
        same = "yes" if eng_ids == serial_ids else f"{sum(a == b for a, b in zip(eng_ids, serial_ids))}/{c}"
        e, b, s = total / best["engine"], total / best["batched"], total / best["serial"]
        print(f"{c:>11} | {e:>12.1f} | {b:>16.1f} | {s:>19.1f} | {e / b:>16.2f}x | {e / s:>19.2f}x | "
              f"{forward_share:>12.0%} | {same}")
    print("(forward share: part of the engine's decode-step time spent inside the model's forward; the rest is "
          "sampling, detokenisation and batching bookkeeping)")


def api_overhead(model_arg: str, engine: HFEngine, n_requests: int, new_tokens: int) -> None:
    print(f"\n== API added latency: {n_requests} sequential chat requests, {new_tokens} new tokens each ==")
    if importlib.util.find_spec("clawloop.api.app") is None:
        print("skipped: clawloop.api.app is not available")
        return
    import httpx

    from clawloop.config import Config
    from clawloop.serve import Server

    question = QUESTIONS[0]
    body = {"model": "clawloop", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": new_tokens}
    with tempfile.TemporaryDirectory() as run_dir:
        config = Config.load(env={}, model=model_arg, port=0, run_dir=run_dir)
        server = Server(config, engine=engine).start()
        try:
            prompt = server.service.renderer.render(body["messages"], None, None).ids
            params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
            api_s, engine_s = [], []
            with httpx.Client(base_url=server.base_url, timeout=600) as http:
                http.post("/v1/chat/completions", json=body).raise_for_status()  # warm-up
                for i in range(n_requests):  # alternating, so a change in machine load hits both
                    t0 = time.perf_counter()
                    asyncio.run(engine.generate(prompt, params))
                    engine_s.append(time.perf_counter() - t0)
                    # A fresh session per request, so each is a first turn (no pairing work piles up).
                    t0 = time.perf_counter()
                    r = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"bench-{i}"})
                    api_s.append(time.perf_counter() - t0)
                    r.raise_for_status()
                    assert r.json()["usage"]["completion_tokens"] == new_tokens
        finally:
            server.stop()
    api_ms, eng_ms = statistics.median(api_s) * 1000, statistics.median(engine_s) * 1000
    added_ms = statistics.median(a - e for a, e in zip(api_s, engine_s)) * 1000
    print(f"median per request: engine.generate {eng_ms:.1f} ms, API {api_ms:.1f} ms ({api_ms / eng_ms:.3f}x); "
          f"median added per request pair: {added_ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default, tiny, or a local HF model folder")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side (best is kept)")
    parser.add_argument("--api-requests", type=int, default=6)
    parser.add_argument("--api-new-tokens", type=int, default=16)
    parser.add_argument("--skip-api", action="store_true")
    args = parser.parse_args()

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = model_files.resolve_model(args.model)
    model = model_files.load_model(model_dir, dtype="float32", device="cpu")
    tokenizer = model_files.load_tokenizer(model_dir)
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model {model_dir.name} ({n_params:.1f}M params), cpu, {threads} threads, torch {torch.__version__}")
    # No EOS on the engine side either: both sides generate exactly the requested number of tokens.
    engine = HFEngine(model, tokenizer, num_threads=threads, max_batch_size=max(args.concurrency),
                      eos_token_ids=[], model_name=model_dir.name)
    try:
        throughput(model, tokenizer, engine, args.concurrency, args.new_tokens, args.repeats)
        if args.skip_api:
            print("\n== API added latency ==\nskipped (--skip-api)")
        else:
            api_overhead(args.model, engine, args.api_requests, args.api_new_tokens)
    finally:
        engine.close_sync()


if __name__ == "__main__":
    main()
