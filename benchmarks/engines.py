"""The embedded engine against vLLM: the same model, the same prompts, the same requests, side by side.

* Generation: ``c`` requests in flight at once (c = ``--concurrency``, default 1 8 32), greedy, at most
  ``--new-tokens`` tokens each (both engines stop at EOS, so the token counts are reported, not assumed).
  Tokens/s = generated tokens / wall time.
* Scoring: ``--score-requests`` (prompt, response) pairs, the responses being the embedded engine's own greedy
  answers, scored with top-4 at temperature 1 (vLLM: one ``prompt_logprobs`` probe per request) and at
  ``--score-temperature`` (vLLM: the probe plus exact per-position requests where the tail bound is too loose;
  their count is printed). Tokens/s = response tokens scored / wall time. The two engines' log-probs are compared
  too (max |difference|), so a fast wrong answer shows.

vLLM runs in its own server process started from ``.venv-vllm`` (or ``--vllm-python`` /
``$CLAWLOOP_VLLM_PYTHON``), or an existing one given with ``--url``. By default the server compiles the model
(torch.compile; a first start takes several minutes on a small CPU, later starts reuse vLLM's compile cache);
``--eager`` skips that. Note the CPU layout: the embedded engine uses ``--threads`` torch threads in this
process; vLLM's CPU build binds its worker to its own cores (one core on a 2-core machine).

    .venv/bin/python benchmarks/engines.py
    .venv/bin/python benchmarks/engines.py --eager --concurrency 1 8 --new-tokens 32
    .venv/bin/python benchmarks/engines.py --url http://127.0.0.1:8000 --served-name base
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from clawloop.engines import model_files  # noqa: E402
from clawloop.engines.base import SamplingParams, ScoreRequest  # noqa: E402
from clawloop.engines.hf import HFEngine  # noqa: E402
from clawloop.engines.vllm import VLLMEngine  # noqa: E402
from clawloop.engines.vllm_server import VLLMServer, VLLMServerSettings  # noqa: E402
from benchmarks.prompts import QUESTIONS, chat_prompt  # noqa: E402


async def generation_rate(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in results)
    return tokens / elapsed, tokens


async def scoring_rate(engine, requests: list[ScoreRequest]) -> tuple[float, list]:
    start = time.perf_counter()
    results = await engine.score(requests)
    elapsed = time.perf_counter() - start
    return sum(len(r.response_ids) for r in requests) / elapsed, results


def max_gap(a_results, b_results) -> float:
    return max(float((a.logprobs_T - b.logprobs_T).abs().max()) for a, b in zip(a_results, b_results))


async def run(args, hf: HFEngine, vllm: VLLMEngine, tokenizer) -> list[tuple[str, float, float, str]]:
    rows: list[tuple[str, float, float, str]] = []
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    await hf.generate(prompts[0], warm)
    await vllm.generate(prompts[0], warm)
    for c in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(c)]
        hf_rate, hf_tokens = await generation_rate(hf, batch, args.new_tokens)
        vllm_rate, vllm_tokens = await generation_rate(vllm, batch, args.new_tokens)
        rows.append((f"generate, concurrency {c}", hf_rate, vllm_rate, f"tokens {hf_tokens} / {vllm_tokens}"))
        print(f"  done: concurrency {c}", flush=True)

    answers = await asyncio.gather(*(hf.generate(prompts[i % len(prompts)],
                                                 SamplingParams(temperature=0.0, max_tokens=args.score_tokens))
                                     for i in range(args.score_requests)))
    for temperature in (1.0, args.score_temperature):
        requests = [ScoreRequest(prompts[i % len(prompts)], g.token_ids, top_k=4, temperature=temperature)
                    for i, g in enumerate(answers)]
        hf_rate, hf_results = await scoring_rate(hf, requests)
        before = vllm.stats["score_position"]
        vllm_rate, vllm_results = await scoring_rate(vllm, requests)
        exact = vllm.stats["score_position"] - before
        positions = sum(len(r.response_ids) for r in requests)
        rows.append((f"score top-4, T={temperature:g}", hf_rate, vllm_rate,
                     f"exact positions {exact}/{positions}, max|dlogp| {max_gap(hf_results, vllm_results):.1e}"))
        print(f"  done: scoring T={temperature:g}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default, or a local HF model folder vLLM can serve")
    parser.add_argument("--url", default="", help="attach to this vLLM server instead of starting one")
    parser.add_argument("--served-name", default="base", help="the served model name (with --url)")
    parser.add_argument("--vllm-python", default="", help="python with vllm (default: .venv-vllm, "
                                                           "$CLAWLOOP_VLLM_PYTHON)")
    parser.add_argument("--eager", action="store_true", help="start vLLM without torch.compile")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--score-requests", type=int, default=8)
    parser.add_argument("--score-tokens", type=int, default=64, help="response length of the scored answers")
    parser.add_argument("--score-temperature", type=float, default=0.6)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the embedded engine")
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    args = parser.parse_args()

    model_dir = model_files.resolve_model(args.model)
    tokenizer = model_files.load_tokenizer(model_dir)
    server = None
    if args.url:
        server = VLLMServer.attach(args.url, served_model_name=args.served_name)
    else:
        settings = VLLMServerSettings(
            model=str(model_dir), python=args.vllm_python, dtype="float32", max_model_len=2048,
            max_num_seqs=max(args.concurrency), max_logprobs=64, enforce_eager=args.eager, block_size=32,
            startup_timeout_s=args.startup_timeout,
        )
        server = VLLMServer(settings)
    print(f"starting/attaching vLLM for {model_dir.name} ...", flush=True)
    server.start()
    print(f"vLLM ready at {server.url} after {server.startup_s:.0f} s (log {server.log_path})", flush=True)
    hf = HFEngine(model_dir, device="cpu", num_threads=args.threads, max_batch_size=max(args.concurrency))
    vllm = server.engine(tokenizer=tokenizer)
    torch.set_num_threads(args.threads)
    try:
        async def go():
            await vllm.connect()
            try:
                return await run(args, hf, vllm, tokenizer)
            finally:
                await vllm.close()

        rows = asyncio.run(go())
    finally:
        hf.close_sync()
        server.stop()

    print(f"\nmodel {model_dir.name}, float32, CPU; HF threads {args.threads}; vLLM "
          f"{'eager' if args.eager else 'compiled'}{' (attached)' if args.url else ''}")
    print(f"{'':32s} {'HFEngine tok/s':>15s} {'VLLMEngine tok/s':>17s} {'vLLM/HF':>8s}  notes")
    for name, hf_rate, vllm_rate, note in rows:
        print(f"{name:32s} {hf_rate:15.1f} {vllm_rate:17.1f} {vllm_rate / hf_rate:8.2f}  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
