"""Forward+backward time and peak memory of the top-k select OPD loss, clawloop vs the naive approach.

Variants (same inputs, same downstream objective; only how ℓ_θ at the K subset ids is obtained differs):

* ``clawloop``   — ``clawloop.losses.logprobs_at``: one chunked log-softmax per position inside a custom
                   autograd Function, then gathers.
* ``autograd``   — one plain ``torch.log_softmax`` over [T, V] with ordinary autograd, then one gather.
* ``naive``      — the original's approach: for each of the K top-k columns, a clone of the logits does its own
                   log-softmax and gathers one column (K copies of [T, V] kept for backward).

With ``--support`` it measures the teacher-support term instead (``clawloop.losses.support``), side by side in one
run at the same T, V and dtype:

* ``clawloop``   — top-k select alone (as above), the reference of the ratios;
* ``support4`` / ``support16`` — top-k select plus the support KL over the teacher's top-4 / top-16 ids, their
                   ids gathered by the same single chunked log-softmax call (more columns, nothing [T, V] more);

and prints what the stored teacher targets (``TeacherScores`` with its record-only fields, C candidates) cost
per response token at K' = 4 and 16.

Each variant runs in a fresh subprocess. Peak memory is the kernel's resident-set high-water mark (VmHWM, reset
through /proc/self/clear_refs just before the measured run) minus the resident set after the inputs exist, so it
sees every allocation torch makes (tracemalloc would not). Time is the best of ``--repeats`` forward+backward runs.

    .venv/bin/python benchmarks/losses.py            # V = 49,152 and 151,936, T = 2,048, K = 4, C = 3
    .venv/bin/python benchmarks/losses.py --quick    # small shapes, a few seconds
    .venv/bin/python benchmarks/losses.py --support  # the support term's time and memory, and target bytes
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = ("clawloop", "autograd", "naive")
SUPPORT_VARIANTS = ("clawloop", "support4", "support16")
LABELS = {
    "clawloop": "clawloop (chunked, 1 log-softmax)",
    "autograd": "plain autograd log_softmax",
    "naive": "naive (K logit copies)",
    "support4": "top-k select + support KL, K'=4",
    "support16": "top-k select + support KL, K'=16",
}


# ---- child process ----------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _make_inputs(T: int, V: int, K: int, C: int, seed: int):
    """Random logits and top-k targets with partly overlapping student/teacher sets (no [C, T, V] tables)."""
    import torch

    from clawloop.losses import TopKTargets

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 3
    stride = V // (K * (C + 2))
    base_T_1 = torch.randint(0, V, (T, 1), generator=g)
    student_ids = (base_T_1 + stride * torch.arange(K)) % V
    # Candidate h keeps the student's first K-1-h ids and replaces the rest by ids of its own, so the
    # candidates' overlaps differ (K-1, K-2, ...) and hint selection has something to choose.
    j = torch.arange(K)
    teacher_ids = torch.stack([
        (base_T_1 + stride * torch.where(j < K - 1 - h, j, K + j + h * K)) % V for h in range(C)])
    full_T_V = torch.log_softmax(logits, -1)  # setup only, freed before measuring
    lp_student = full_T_V.gather(-1, student_ids) + 0.1 * torch.randn(T, K, generator=g)
    old_at_teacher = torch.stack([full_T_V.gather(-1, teacher_ids[h]) for h in range(C)])
    del full_T_V
    targets = TopKTargets(
        student_ids_T_K=student_ids,
        student_logprobs_T_K=lp_student,
        old_at_teacher_C_T_K=old_at_teacher,
        teacher_ids_C_T_K=teacher_ids,
        teacher_logprobs_C_T_K=old_at_teacher + 0.5 * torch.randn(C, T, K, generator=g),
        teacher_at_student_C_T_K=lp_student.unsqueeze(0) + 0.5 * torch.randn(C, T, K, generator=g),
    ).validate(vocab_size=V)
    return logits, targets


def _support_inputs(logits, width: int, seed: int):
    """The selected hint's teacher top-``width`` ids and log-probs (distinct ids, 60-95% of the mass on them)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    T, V = logits.shape
    # Evenly spaced from a random start: distinct within a row, and no [T, V]-sized temporaries whose freed pages
    # would later serve the measured run's gradient and hide it from the peak.
    ids_T_W = (torch.randint(0, V, (T, 1), generator=g) + (V // (width + 1)) * torch.arange(width)) % V
    raw_T_W = torch.rand(T, width, generator=g) + 0.05
    mass_T_1 = 0.6 + 0.35 * torch.rand(T, 1, generator=g)
    teacher_T_W = torch.log(raw_T_W / raw_T_W.sum(-1, keepdim=True) * mass_T_1).sort(-1, descending=True).values
    return ids_T_W, teacher_T_W


def _loss(variant: str, logits, targets, args, support=None):
    import torch

    from clawloop import losses

    settings = dict(adv_diff_clip=1.0, eps_clip=0.2, eps_clip_high=0.28)
    subset = losses.topk_subset(targets, hint_selection=args.hint_selection, subset_mode=args.subset_mode)
    if variant.startswith("support"):
        # As sample_objective does it: the support ids ride along in the one chunked log-softmax.
        support_ids_T_W, support_teacher_T_W = support
        K = subset.ids_T_K.shape[1]
        cur_T_N = losses.logprobs_at(logits, torch.cat([subset.ids_T_K, support_ids_T_W], 1), args.temperature)
        select_T = losses.topk_select_loss(cur_T_N[:, :K], subset, **settings)[0]
        return select_T + losses.teacher_support_kl(cur_T_N[:, K:], support_teacher_T_W)
    if variant == "clawloop":
        cur_T_K = losses.logprobs_at(logits, subset.ids_T_K, args.temperature)
    elif variant == "autograd":
        cur_T_K = torch.log_softmax(logits / args.temperature, -1).gather(1, subset.ids_T_K)
    else:
        columns = []
        for k in range(subset.ids_T_K.shape[1]):
            copy_T_V = logits.clone() / args.temperature
            columns.append(torch.log_softmax(copy_T_V, -1).gather(1, subset.ids_T_K[:, k:k + 1]))
        cur_T_K = torch.cat(columns, 1)
    return losses.topk_select_loss(cur_T_K, subset, **settings)[0]


def run_child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    # Warm-up on a tiny input so one-off costs (thread pool, kernel dispatch tables) are not measured.
    width = int(args.child[len("support"):]) if args.child.startswith("support") else 0
    tiny_logits, tiny_targets = _make_inputs(8, 1024, args.k, args.candidates, args.seed)
    tiny_support = _support_inputs(tiny_logits, width, args.seed) if width else None
    _loss(args.child, tiny_logits.requires_grad_(True), tiny_targets, args, tiny_support).sum().backward()
    del tiny_logits, tiny_targets, tiny_support
    logits, targets = _make_inputs(args.tokens, args.vocab, args.k, args.candidates, args.seed)
    support = _support_inputs(logits, width, args.seed) if width else None
    logits.requires_grad_(True)
    gc.collect()
    baseline_kib = _status_kib("VmRSS")
    exact_peak = _reset_peak()
    times, peak_extra_kib, loss_T = [], 0, None
    for i in range(args.repeats):
        logits.grad = None
        gc.collect()
        if i > 0:
            exact_peak = _reset_peak() and exact_peak
        start = time.perf_counter()
        loss_T = _loss(args.child, logits, targets, args, support)
        loss_T.sum().backward()
        times.append(time.perf_counter() - start)
        peak_extra_kib = max(peak_extra_kib, _status_kib("VmHWM") - baseline_kib)
    print(json.dumps({
        "variant": args.child,
        "time_s": min(times),
        "peak_extra_bytes": peak_extra_kib * 1024,
        "exact_peak": exact_peak,
        "loss_sum": float(loss_T.detach().sum()),
        "grad_checksum": float(logits.grad.double().abs().sum()),
    }))


# ---- parent ------------------------------------------------------------------------------------------------


def run_variant(variant: str, vocab: int, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--vocab", str(vocab),
           "--tokens", str(args.tokens), "--k", str(args.k), "--candidates", str(args.candidates),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--seed", str(args.seed),
           "--temperature", str(args.temperature), "--subset-mode", args.subset_mode,
           "--hint-selection", args.hint_selection]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{variant} at V={vocab} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes (V=8,192, T=256) for a fast check")
    parser.add_argument("--vocab", type=int, nargs="*", default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--subset-mode", default="student")
    parser.add_argument("--hint-selection", default="sequence_optimal")
    parser.add_argument("--variants", nargs="*", default=None, choices=VARIANTS + SUPPORT_VARIANTS[1:])
    parser.add_argument("--support", action="store_true",
                        help="measure the teacher-support term next to top-k select, and the stored target bytes")
    parser.add_argument("--child", choices=VARIANTS + SUPPORT_VARIANTS[1:], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.vocab = args.vocab[0]
        run_child(args)
        return
    vocabs = args.vocab or ([8_192] if args.quick else [49_152, 151_936])
    args.tokens = args.tokens or (256 if args.quick else 2_048)
    if args.variants is None:
        args.variants = list(SUPPORT_VARIANTS if args.support else VARIANTS)
    if args.support:
        print_target_bytes(args.candidates, args.k)

    print(f"top-k select OPD loss, forward+backward; T={args.tokens:,} K={args.k} C={args.candidates} "
          f"subset={args.subset_mode} selection={args.hint_selection} tau={args.temperature} "
          f"threads={args.threads}, best of {args.repeats}")
    for vocab in vocabs:
        logits_bytes = args.tokens * vocab * 4
        results = {v: run_variant(v, vocab, args) for v in args.variants}
        ref = results.get("clawloop") or next(iter(results.values()))
        print(f"\nV={vocab:,}  (one float32 TxV logits tensor = {logits_bytes / 2**30:.3f} GiB)")
        header = (f"{'variant':36s} {'time s':>8s} {'peak extra GiB':>15s} {'extra / TxV':>12s} "
                  f"{'time vs clawloop':>17s} {'extra vs clawloop':>18s} {'|loss diff|':>12s}")
        print(header)
        print("-" * len(header))
        for variant, r in results.items():
            extra = r["peak_extra_bytes"]
            print(f"{LABELS[variant]:36s} {r['time_s']:8.3f} {extra / 2**30:15.3f} {extra / logits_bytes:11.2f}x "
                  f"{r['time_s'] / ref['time_s']:16.2f}x {extra / max(1, ref['peak_extra_bytes']):17.2f}x "
                  + (f"{'(other loss)':>12s}" if variant.startswith("support") else
                     f"{abs(r['loss_sum'] - ref['loss_sum']):12.2e}"))
        if not all(r["exact_peak"] for r in results.values()):
            print("(peak reset via /proc/self/clear_refs unavailable: peaks include setup)")


def print_target_bytes(candidates: int, k: int, tokens: int = 256) -> None:
    """Bytes per response token of one sample's stored teacher targets (``TeacherScores`` with every record-only
    field the trainer fills), raw tensor bytes and as the safetensors blob the store and the wire carry."""
    import torch

    from clawloop.wire import TeacherScores, encode_tensors

    print(f"stored teacher targets per response token (C={candidates} candidates, student k={k}, T={tokens}):")
    print(f"{'teacher K':>10s} {'raw bytes':>10s} {'safetensors':>12s} {'base64 (wire)':>14s} {'vs K=k':>8s}")
    sizes = {}
    for width in (k, 16):
        C, T = candidates, tokens
        scores = TeacherScores(
            student_ids_T_K=torch.zeros(T, k, dtype=torch.int64),
            teacher_ids_C_T_K=torch.zeros(C, T, width, dtype=torch.int64),
            teacher_logprobs_C_T_K=torch.zeros(C, T, width),
            teacher_at_student_C_T_K=torch.zeros(C, T, k),
            hint_lens_C=torch.zeros(C, dtype=torch.int64),
            teacher_token_logprobs_C_T=torch.zeros(C, T),
            student_logprobs_T_K=torch.zeros(T, k),
            student_token_logprobs_T=torch.zeros(T))
        raw = sum(t.numel() * t.element_size() for t in scores.tensors().values()) / T
        text = encode_tensors(scores.tensors())
        blob = len(text) * 3 / 4 / T
        sizes[width] = blob
        print(f"{width:>10d} {raw:>10.0f} {blob:>12.0f} {len(text) / T:>14.0f} {blob / sizes[k]:>7.2f}x")
    print()


if __name__ == "__main__":
    main()
