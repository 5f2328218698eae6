"""Could the publication gate read the reference in bfloat16? Speed and agreement, side by side, on one machine.

    python benchmarks/reference_dtype.py                  # SmolLM2-135M-Instruct, 2 threads
    python benchmarks/reference_dtype.py --rows 28 --prompt-tokens 150 --threads 1

The gate's KL forward and its preference reading are forwards of the starting weights over many rows (the probes'
answers); its answers are decoded a token at a time. Printed for float32 and bfloat16 copies of the same weights:

* ``prefill``: one forward over ``--rows`` rows of ``--prompt-tokens`` tokens (what the two scoring forwards do);
* ``decode``: one decoding step of the same rows, with their KV caches, and of one row alone (mean of
  ``--steps``);
* then the KL (nats/token) between the two precisions' next-token distributions over a few chat answers, mean and
  largest: what a gate reading the reference in bfloat16 and the candidate in float32 would measure for a
  candidate equal to the reference. The gate's ``NEAR_IDENTICAL_KL`` is printed beside it.

Ratios are float32 over bfloat16, measured in one run; the machine's own load moves both.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.prompts import chat_prompt  # noqa: E402
from clawloop.engines.model_files import load_model, load_tokenizer, resolve_model  # noqa: E402
from clawloop.gate.gate import NEAR_IDENTICAL_KL  # noqa: E402

ANSWERS = [
    ("What is the capital of France?",
     "The capital of France is Paris, a city known for its art, culture and history. It lies on the Seine."),
    ("Why do stars shine?",
     "Stars shine because of nuclear fusion in their cores, where hydrogen nuclei combine into helium and release "
     "energy as light and heat."),
    ("What is a tree?",
     "A tree is a tall plant with a woody trunk, branches and leaves, which makes its food from sunlight."),
]


@torch.no_grad()
def timings(model: torch.nn.Module, rows: int, prompt_tokens: int, steps: int, vocab: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    ids_B_T = torch.randint(100, vocab - 1, (rows, prompt_tokens), generator=gen)
    model(ids_B_T[:2, :16])  # warm-up: first-call allocations are not the model's speed
    t = time.perf_counter()
    out = model(ids_B_T, use_cache=True)
    prefill = time.perf_counter() - t
    cache, next_B_1 = out.past_key_values, ids_B_T[:, -1:]
    t = time.perf_counter()
    for _ in range(steps):
        cache = model(next_B_1, past_key_values=cache, use_cache=True).past_key_values
    decode = (time.perf_counter() - t) / steps
    cache = model(ids_B_T[:1], use_cache=True).past_key_values
    t = time.perf_counter()
    for _ in range(steps):
        cache = model(next_B_1[:1], past_key_values=cache, use_cache=True).past_key_values
    single = (time.perf_counter() - t) / steps
    return {"prefill": prefill, "decode": decode, "single": single}


@torch.no_grad()
def precision_kl(model_32: torch.nn.Module, model_16: torch.nn.Module, tokenizer) -> list[torch.Tensor]:
    """Per answer, KL(p_float32 || p_bfloat16) at each answer position."""
    kls = []
    for question, answer in ANSWERS:
        prompt_ids = chat_prompt(tokenizer, question)
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids
        ids_1_T = torch.tensor([prompt_ids + answer_ids])
        start = len(prompt_ids) - 1
        logp_32 = torch.log_softmax(model_32(ids_1_T).logits[0, start:-1].float(), -1)
        logp_16 = torch.log_softmax(model_16(ids_1_T).logits[0, start:-1].float(), -1)
        kls.append((logp_32.exp() * (logp_32 - logp_16)).sum(-1))
    return kls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="Model name or folder (default: the default model).")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--rows", type=int, default=28, help="Rows per forward (the gate's guard probes: 28).")
    parser.add_argument("--prompt-tokens", type=int, default=150, help="Tokens per row in the prefill.")
    parser.add_argument("--steps", type=int, default=16, help="Decoding steps timed per measurement.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    model_32 = load_model(path, device="cpu", dtype=torch.float32).eval()
    model_16 = load_model(path, device="cpu", dtype=torch.bfloat16).eval()
    vocab = int(model_32.config.vocab_size)
    measured = {name: timings(model, args.rows, args.prompt_tokens, args.steps, vocab)
                for name, model in (("float32", model_32), ("bfloat16", model_16))}
    print(f"{path.name}, {args.threads} threads, {args.rows} rows")
    print(f"{'':>10} {'prefill ' + str(args.prompt_tokens) + ' tokens':>20} {'decode step':>12} {'1 row':>8}")
    for name, t in measured.items():
        print(f"{name:>10} {t['prefill']:>19.2f}s {t['decode'] * 1e3:>10.0f}ms {t['single'] * 1e3:>6.0f}ms")
    a, b = measured["float32"], measured["bfloat16"]
    print(f"{'ratio':>10} {a['prefill'] / b['prefill']:>19.2f}x {a['decode'] / b['decode']:>11.2f}x "
          f"{a['single'] / b['single']:>7.2f}x")
    kls = precision_kl(model_32, model_16, tokenizer)
    for (question, _), kl_T in zip(ANSWERS, kls):
        print(f"KL float32 || bfloat16 over the answer to {question!r}: mean {float(kl_T.mean()):.2e}, "
              f"largest {float(kl_T.max()):.2e} nats/token")
    print(f"NEAR_IDENTICAL_KL (the gate's near-identical bound): {NEAR_IDENTICAL_KL:.0e} nats/token")


if __name__ == "__main__":
    main()
