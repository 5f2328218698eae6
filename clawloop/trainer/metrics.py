"""Where step metrics go: ``run_dir/metrics.jsonl`` always, TensorBoard / W&B when installed and enabled, and a
progress line on the console.

``metrics.jsonl`` is appended to (one JSON object per optimizer step, flushed at once) and never truncated, so
a resumed run continues the same file. A backend named in ``metrics_backends`` but not installed is reported
once and skipped; training never fails because of a metrics sink.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

# Loss terms shown on the console line, in this order, when present.
_CONSOLE_KEYS = ("loss", "grpo_loss", "opd_loss", "combine_loss", "topk_kl_loss", "ref_kl", "grad_norm")


def step_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics as the store records them: plain JSON values, a non-finite number as null, a tensor or
    numpy scalar as a float."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        else:
            v = float(v)
            out[k] = v if math.isfinite(v) else None
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so the line stays parseable and the problem visible."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    def __init__(self, run_dir: str | Path, backends: list[str] | tuple[str, ...] = ("jsonl",),
                 console: TextIO | None = sys.stderr, run_name: str = "clawloop"):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console = console
        self._jsonl = open(self.path, "a", encoding="utf-8") if "jsonl" in backends else None
        self._tb = None
        self._wandb = None
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            except Exception as exc:  # tensorboard not installed
                log.warning("metrics: tensorboard requested but unavailable (%s); skipping it", exc)
        if "wandb" in backends:
            try:
                import wandb

                self._wandb = wandb.init(project=run_name, dir=str(run_dir), resume="allow")
            except Exception as exc:
                log.warning("metrics: wandb requested but unavailable (%s); skipping it", exc)

    def write(self, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("step", 0))
        record = {"time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(f"train/{key}", value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in numeric.items()}, step=step)

    def progress(self, metrics: dict[str, Any], waiting: int) -> None:
        """One console line: samples waiting, step, loss terms, version."""
        if self.console is None:
            return
        self.console.write(progress_line(metrics, waiting) + "\n")
        self.console.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def progress_line(metrics: dict[str, Any], waiting: int) -> str:
    parts = [f"[train] step {int(metrics.get('step', 0))}", f"v{int(metrics.get('policy_version', 0))}",
             f"waiting {waiting}", f"samples {int(metrics.get('samples', 0))}"]
    for key in _CONSOLE_KEYS:
        value = metrics.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{key} {value:.4g}")
    if "step_time_s" in metrics:
        parts.append(f"{metrics['step_time_s']:.1f}s")
    return " | ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
