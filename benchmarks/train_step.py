"""Training-step throughput and peak memory on the default model (SmolLM2-135M-Instruct), full vs LoRA.

For each variant a fresh subprocess loads the model, writes ``samples × steps`` hybrid-method samples into a
temporary store (real chat-template prompts, ``--tokens`` response tokens of real text, two hint candidates, one
sample in two without a hint; the teacher's scores are made up at the asked ids by ``benchmarks/synthetic.py``),
and runs ``--steps`` trainer steps through
``clawloop.trainer.core.Trainer`` — the same code the server runs. It reports, per step, samples/s and where the
time went:

* forward  — the decoder over prompt + response (hidden states),
* loss     — output layer at the response positions + the objective (one chunked log-softmax) + their backward,
* backward — the decoder's backward,
* retain   — the retain term's forwards and backwards on its general prompts (``lora-retain``; docs/retain.md),
* optimizer — gradient clipping and the AdamW update,

and the process's peak resident memory (VmHWM) and the resident memory right after loading the model, so the
difference is what training adds. The first step includes one-time allocations (AdamW state); the last step is
the steady state.

    .venv/bin/python benchmarks/train_step.py                       # 4 samples x 256 tokens, 2 steps, full + LoRA
    .venv/bin/python benchmarks/train_step.py --samples 8 --tokens 512 --variants full,lora,full-sep
    .venv/bin/python benchmarks/train_step.py --variants lora,lora-retain --steps 3     # the retain term's cost

Long prompts (``--lengths``): one sample per step of each given length in tokens (an OpenClaw-sized agent prompt
is 3-13k tokens): a 128-token response after a prompt of the rest, full and LoRA, under each ``--approaches``
entry:

* ``today``  — the step as it was before the memory work: sdpa attention, every activation kept for the
  backward (no checkpointing), no token budget;
* ``eager``  — the same with eager attention (an ``[heads, L, L]`` matrix kept per layer);
* ``new``    — the defaults: sdpa, activation checkpointing on long micro-batches, token budgets;
* ``separate`` — the defaults, with the teacher's top-k ids taken by a no-gradient forward before the loss's own
  (what a step of one micro-batch did before it took them from the loss's forward).

Each case runs alone in a fresh subprocess that a watchdog kills once its resident memory passes ``--cap-gb``
(an unbounded case would otherwise take the whole machine down); such a case prints as "> cap (stopped)".
Peak resident memory is the child's VmHWM.

    .venv/bin/python benchmarks/train_step.py --lengths 1024,4096,8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.synthetic import FILLER, RandomTeacher, add_sample, write_samples  # noqa: E402

VARIANTS = {
    "full": {"lora": False},
    "lora": {"lora": True},
    # The separate no-grad old-policy forward (what several PPO epochs need), for comparison with the fused one.
    "full-sep": {"lora": False, "fuse_old": False},
    # The retain term at the demo preset's weight (4 general prompts per update; docs/retain.md).
    "lora-retain": {"lora": True, "retain_coef": 4.0},
}
PHASES = ("time_old_forward_s", "time_forward_s", "time_loss_s", "time_backward_s", "time_retain_s",
          "time_optimizer_s")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(variant: str, samples: int, tokens: int, steps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from clawloop.config import Config
    from clawloop.engines.model_files import default_model_dir, load_tokenizer
    from clawloop.store import Store
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion

    opts = VARIANTS[variant]
    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        config = Config.from_dict(dict(model=str(model_dir), device="cpu", run_dir=tmp, method="hybrid",
                                       lora=opts["lora"], retain_coef=opts.get("retain_coef", 0.0),
                                       # the step's own memory: no frozen copy kept only for the gate
                                       gate_fixed_reference=False,
                                       rollout_batch_size=samples,
                                       micro_batch_size=min(samples, 4), metrics_backends=["jsonl"]))
        store = Store(Path(tmp) / "store.sqlite")
        write_samples(store, tokenizer, samples * steps, tokens)
        trainer = Trainer(config, store, LocalVersion(), console=None, fuse_old=opts.get("fuse_old"),
                          teacher=RandomTeacher(len(tokenizer), config.topk))
        rss_loaded_kib = _status_kib("VmRSS")
        params = sum(p.numel() for p in trainer.models.trainable_parameters())
        results = []
        for _ in range(steps):
            lease, leased = store.lease_samples(samples)
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = trainer.run_batch(lease, leased)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            results.append({"wall_s": wall, "cpu_s": cpu, "step_time_s": metrics["step_time_s"],
                            "samples": metrics["samples"],
                            "tokens": metrics["tokens"], **{p: metrics.get(p, 0.0) for p in PHASES},
                            "loss": metrics["loss"]})
        trainer.close()
        store.close()
    return {"variant": variant, "trainable_params": params, "steps": results,
            "rss_after_load_mib": rss_loaded_kib / 1024, "peak_rss_mib": _status_kib("VmHWM") / 1024}


APPROACHES = {
    "today": {"attn_implementation": "sdpa", "gradient_checkpointing": "off", "max_train_tokens": 1 << 20,
              "micro_batch_tokens": 1 << 20},
    "eager": {"attn_implementation": "eager", "gradient_checkpointing": "off", "max_train_tokens": 1 << 20,
              "micro_batch_tokens": 1 << 20},
    "new": {},
    # The defaults, but the teacher's top-k ids from a no-gradient forward before the loss's own (as before a step
    # of one micro-batch took them from the loss's forward).
    "separate": {},
}
LONG_RESPONSE_TOKENS = 128


def child_long(variant: str, approach: str, sample_tokens: int, threads: int) -> dict:
    """One training step on one sample of ``sample_tokens`` tokens, prompt + response (see the module docstring)."""
    import torch

    torch.set_num_threads(threads)
    from clawloop.config import Config
    from clawloop.engines.model_files import default_model_dir, load_tokenizer
    from clawloop.store import Store
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion

    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    T = LONG_RESPONSE_TOKENS
    prompt_tokens = sample_tokens - T
    with tempfile.TemporaryDirectory() as tmp:
        config = Config.from_dict(dict(model=str(model_dir), device="cpu", run_dir=tmp, method="hybrid",
                                       lora=VARIANTS[variant]["lora"], rollout_batch_size=1, gate_fixed_reference=False,
                                       metrics_backends=["jsonl"], **APPROACHES[approach]))
        store = Store(Path(tmp) / "store.sqlite")
        filler = tokenizer(FILLER * (prompt_tokens // 20 + 2), add_special_tokens=False)["input_ids"]
        messages = [{"role": "user", "content": "Summarise the meeting notes."}]
        head = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        # The filler goes into the user message, before its "<|im_end|>" and the assistant header (6 tokens).
        prompt = head[:-6] + list(filler[:prompt_tokens - len(head)]) + head[-6:]
        response = list(filler[:T - 1]) + [2]
        add_sample(store, prompt, response, messages, 0, hinted=True, reward=1.0)
        trainer = Trainer(config, store, LocalVersion(), console=None,
                          teacher=RandomTeacher(len(tokenizer), config.topk),
                          ask_in_loss_forward=False if approach == "separate" else None)
        rss_loaded_kib = _status_kib("VmRSS")
        lease, leased = store.lease_samples(1)
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = trainer.run_batch(lease, leased)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        trainer.close()
        store.close()
    if metrics is None:
        raise RuntimeError(f"the sample was not trained: {store.drop_reasons()}")
    return {"variant": variant, "approach": approach, "sample_tokens": len(prompt) + T, "wall_s": wall, "cpu_s": cpu,
            "step_time_s": metrics["step_time_s"], "loss": metrics["loss"],
            "checkpointed": metrics.get("checkpointed_micro_batches", 0.0),
            "rss_after_load_mib": rss_loaded_kib / 1024, "peak_rss_mib": _status_kib("VmHWM") / 1024}


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_long_case(variant: str, approach: str, length: int, args: argparse.Namespace) -> dict:
    """Run one case in a subprocess, killing it when its resident memory passes the cap."""
    cmd = [sys.executable, __file__, "--child-long", f"{variant}:{approach}:{length}", "--threads", str(args.threads)]
    cap_mib = args.cap_gb * 1024
    with tempfile.TemporaryFile("w+") as out:
        err = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        peak = 0.0
        while proc.poll() is None:
            rss = _rss_mib(proc.pid)
            peak = max(peak, rss)
            if rss > cap_mib:
                proc.kill()
                proc.wait()
                return {"variant": variant, "approach": approach, "sample_tokens": length, "stopped": True,
                        "peak_rss_mib": peak}
            time.sleep(0.05)
        out.seek(0)
        lines = out.read().strip().splitlines()
        err.seek(0)
        tail = err.read()[-2000:]
    if proc.returncode != 0 or not lines:
        return {"variant": variant, "approach": approach, "sample_tokens": length, "failed": proc.returncode,
                "peak_rss_mib": peak, "stderr": tail}
    return json.loads(lines[-1])


def report_long(results: list[dict], args: argparse.Namespace, approaches: list[str]) -> None:
    print(f"\nOne training step on SmolLM2-135M-Instruct, CPU, {args.threads} threads: one sample of L tokens "
          f"({LONG_RESPONSE_TOKENS} of them the response), method hybrid (2 hint candidates, k=4); watchdog cap "
          f"{args.cap_gb:g} GB. Peak = peak resident memory of the whole process; time = step wall time (process "
          f"CPU seconds); ratios use wall time.\n")

    def cell(r: dict | None) -> tuple[str, str]:
        if r is None:
            return "-", "-"
        if r.get("stopped"):
            return f"> {args.cap_gb:g} GB (stopped)", "-"
        if "failed" in r:
            return f"failed ({r['failed']})", "-"
        return f"{r['peak_rss_mib'] / 1024:.2f} GB", f"{r['step_time_s']:.0f} s ({r['cpu_s']:.0f})"

    approaches = [a for a in APPROACHES if a in approaches]  # in APPROACHES' order
    by = {(r["variant"], r["approach"], r["sample_tokens"]): r for r in results}
    lengths = sorted({r["sample_tokens"] for r in results})
    header = f"{'variant':<6} {'L':>6} " + " ".join(f"{a + ' peak':>22} {a + ' s (cpu s)':>16}" for a in approaches)
    if "new" in approaches and "today" in approaches:
        header += f" {'peak new/today':>15} {'time new/today':>15}"
    if "new" in approaches and "separate" in approaches:
        header += f" {'time new/separate':>18}"
    print(header)
    print("-" * len(header))
    for variant in [v for v in ("full", "lora") if any(r["variant"] == v for r in results)]:
        for L in lengths:
            row = f"{variant:<6} {L:>6} "
            cells = [cell(by.get((variant, a, L))) for a in approaches]
            row += " ".join(f"{m:>22} {t:>16}" for m, t in cells)
            if "new" in approaches and "today" in approaches:
                new, old = by.get((variant, "new", L)), by.get((variant, "today", L))
                if new and old and "step_time_s" in new and "step_time_s" in old:
                    row += f" {new['peak_rss_mib'] / old['peak_rss_mib']:>15.2f} " \
                           f"{new['step_time_s'] / old['step_time_s']:>15.2f}"
                else:
                    row += f" {'-':>15} {'-':>15}"
            if "new" in approaches and "separate" in approaches:
                new, old = by.get((variant, "new", L)), by.get((variant, "separate", L))
                ok = new and old and "step_time_s" in new and "step_time_s" in old
                row += f" {new['step_time_s'] / old['step_time_s']:>18.2f}" if ok else f" {'-':>18}"
            print(row)


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--samples", str(args.samples), "--tokens", str(args.tokens),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nTraining step on SmolLM2-135M-Instruct, CPU, {args.threads} threads: {args.samples} samples x "
          f"{args.tokens} response tokens per step, method hybrid (half the samples hinted, 2 candidates, k=4)\n")
    header = (f"{'variant':<11} {'step':>4} {'step s':>7} {'cpu s':>7} {'samples/s':>9} {'tokens/s':>8} {'old fwd':>7} "
              f"{'fwd':>6} {'loss':>6} {'bwd':>6} {'retain':>6} {'optim':>6} {'loss %':>6} {'fwd+bwd %':>9}")
    print(header)
    print("-" * len(header))
    for r in results:
        for i, s in enumerate(r["steps"], 1):
            t = s["step_time_s"]
            fb = s["time_forward_s"] + s["time_backward_s"] + s["time_old_forward_s"]
            print(f"{r['variant']:<11} {i:>4} {t:>7.2f} {s['cpu_s']:>7.1f} {s['samples'] / t:>9.2f} "
                  f"{s['tokens'] / t:>8.0f} "
                  f"{s['time_old_forward_s']:>7.2f} {s['time_forward_s']:>6.2f} {s['time_loss_s']:>6.2f} "
                  f"{s['time_backward_s']:>6.2f} {s['time_retain_s']:>6.2f} {s['time_optimizer_s']:>6.2f} "
                  f"{100 * s['time_loss_s'] / t:>6.1f} "
                  f"{100 * fb / t:>9.1f}")
    print()
    print(f"{'variant':<11} {'trainable':>12} {'RSS after load MiB':>19} {'peak RSS MiB':>13} {'added MiB':>10}")
    for r in results:
        print(f"{r['variant']:<11} {r['trainable_params']:>12,} {r['rss_after_load_mib']:>19.0f} "
              f"{r['peak_rss_mib']:>13.0f} {r['peak_rss_mib'] - r['rss_after_load_mib']:>10.0f}")
    if len(results) > 1:
        base = results[0]["steps"][-1]["step_time_s"]
        print()
        for r in results[1:]:
            ratio = r["steps"][-1]["step_time_s"] / base
            print(f"steady-state step time {r['variant']} / {results[0]['variant']}: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="full,lora")
    parser.add_argument("--json", action="store_true", help="Print the raw results as JSON too.")
    parser.add_argument("--lengths", default="",
                        help="Comma-separated prompt lengths in tokens (e.g. 1024,4096,8192): run the long-prompt "
                             "memory comparison instead of the throughput table.")
    parser.add_argument("--approaches", default="new,today,eager",
                        help="For --lengths: new, today, eager, separate.")
    parser.add_argument("--cap-gb", type=float, default=10.0,
                        help="For --lengths: kill a case whose resident memory passes this many GB.")
    parser.add_argument("--results", default="",
                        help="For --lengths: a JSON-lines file each finished case is appended to; cases already "
                             "in it are not run again (a long comparison can be run in parts).")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-long", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.samples, args.tokens, args.steps, args.threads)))
        return
    if args.child_long:
        variant, approach, length = args.child_long.split(":")
        print(json.dumps(child_long(variant, approach, int(length), args.threads)))
        return
    if args.lengths:
        approaches = [a.strip() for a in args.approaches.split(",") if a.strip()]
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        done = {}
        if args.results and Path(args.results).exists():
            for line in Path(args.results).read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    if "failed" not in r:
                        done[(r["variant"], r["approach"], r["sample_tokens"])] = r
        results = []
        # Longest prompts first: they answer the question this comparison asks, and take longest.
        for length in sorted(lengths, reverse=True):
            for variant in variants:
                for approach in approaches:
                    r = done.get((variant, approach, length))
                    if r is None:
                        r = run_long_case(variant, approach, length, args)
                        print(json.dumps(r), file=sys.stderr, flush=True)
                        if args.results:
                            with open(args.results, "a") as f:
                                f.write(json.dumps(r) + "\n")
                    results.append(r)
        report_long(results, args, approaches)
        if args.json:
            print(json.dumps(results, indent=2))
        return
    results = [run_variant(v.strip(), args) for v in args.variants.split(",") if v.strip()]
    report(results, args)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
