"""The starting weights' answers to the shipped probes, kept on disk from one run to the next.

The gate asks the fixed reference (the starting weights) each shipped and knowledge probe once per run, and draws
its sampled knowledge answers with up to ``gate_reference_dice`` sets of dice. Those answers depend on nothing a
run changes: the same weights, prompts, caps and dice give the same tokens. On the CPU default they took 23-67 s of
a run's first check and 130-170 s of the check that first needed the other dice (simulated runs of `brief`), work
every run repeated on the way to its first versions, and a restarted server repeated again.

``KeptAnswers`` is one JSON file per model, beside the converted models in the clawloop cache
(``$CLAWLOOP_CACHE/gate-answers/``). A file's name is a digest of everything the answers depend on that is not
part of a probe:

* the starting weights: the model folder's config and weight files, and the dtype and device kind they were
  loaded with (``weights_fingerprint``);
* the code that decodes and stops the answers (``generation.py``, ``knowledge.py``, the engine's cache helpers)
  and the torch and transformers versions (``code_fingerprint``): a change to either starts a new file.

Inside, each entry's key is a digest of one probe's request: its prompt ids, answer cap, end-of-turn ids, how many
answers are sampled and at what temperature, the dice set, and the facts that end a sampled answer early. Only the
answers (token ids) are kept, never a verdict: the gate judges them afresh with its current rules, so a change to
the guard needs no new file. Only shipped text is ever kept; the run's own prompts (users' conversations) are not.

Reusing an answer changes no decision in exact arithmetic. Float rounding can differ with the batch an answer was
decoded in, as it already does between the gate's own batches (``probe_answers``). Writers on one machine (several
runs, test workers) merge their entries under a file lock and replace the file atomically; a file that cannot be
read is set aside and started again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from clawloop.atomic import hidden_sibling, write_text_atomically

log = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when the file's layout or the meaning of a key changes."""

_CODE_FILES = ("gate/generation.py", "gate/knowledge.py", "engines/hf.py")
"""The sources that decide which tokens an answer has and where it stops (relative to the package)."""


def weights_fingerprint(model_dir: str | Path, *, dtype: str, device_type: str) -> str:
    """A digest of the model folder's config and weight files and of how they were loaded. A weight file is named
    by its size, its modification time and its first and last MiB (a safetensors file's header lists every
    tensor's place): reading a 16 GB model byte for byte would cost a run tens of seconds, and a file rewritten in
    place gets a new modification time."""
    folder = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{dtype}\0{device_type}\0".encode())
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
    if not weights:
        raise FileNotFoundError(f"no weight files in {folder}")
    digest.update((folder / "config.json").read_bytes())
    for path in weights:
        stat = path.stat()
        digest.update(f"\0{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, stat.st_size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return digest.hexdigest()


def code_fingerprint() -> str:
    """A digest of the decoding code and library versions the answers came from."""
    import transformers

    package = Path(__file__).resolve().parent.parent
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{FORMAT}\0{torch.__version__}\0{transformers.__version__}\0".encode())
    for name in _CODE_FILES:
        digest.update(name.encode() + b"\0" + (package / name).read_bytes())
    return digest.hexdigest()


def request_key(name: str, prompt_ids: Sequence[int], *, cap: int, eos_ids: Sequence[int], samples: int,
                temperature: float, dice_set: int, facts: Sequence[str]) -> str:
    """The key of one probe's answers: everything about the request that decides their tokens (``name``, the
    probe's text, also names its dice: ``sampling_uniforms``). ``samples`` 0 is one greedy answer
    (``temperature``, ``dice_set`` and ``facts`` then play no part)."""
    if samples == 0:
        temperature, dice_set, facts = 0.0, 0, ()
    text = json.dumps([name, list(map(int, prompt_ids)), int(cap), sorted(map(int, eos_ids)), int(samples),
                       float(temperature).hex(), int(dice_set), list(facts)], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class KeptAnswers:
    """One model's kept answers (see the module docstring). ``get`` reads the entries loaded when it was made, those
    it was given since, and those another writer has added to the file; ``put`` adds entries and writes them to
    the file, merged with what other writers wrote meanwhile."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._read_mtime_ns: int | None = None
        self._entries: dict[str, list[list[int]]] = self._read()

    @classmethod
    def for_model(cls, model_dir: str | Path, *, dtype: str, device_type: str,
                  root: str | Path | None = None) -> KeptAnswers:
        """The file of the starting weights in ``model_dir`` (``root``: the folder of such files, by default
        ``gate-answers`` in the clawloop cache)."""
        if root is None:
            from clawloop.engines.model_files import cache_root

            root = cache_root() / "gate-answers"
        name = hashlib.blake2b(f"{weights_fingerprint(model_dir, dtype=dtype, device_type=device_type)}\0"
                               f"{code_fingerprint()}".encode(), digest_size=16).hexdigest()
        return cls(Path(root) / f"{name}.json")

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> list[list[int]] | None:
        """The answers kept under ``key``; on a miss, the file is read again if another writer (a run beside this
        one) has replaced it since."""
        found = self._entries.get(key)
        if found is None and self._mtime_ns() != self._read_mtime_ns:
            self._entries = {**self._read(), **self._entries}
            found = self._entries.get(key)
        return found

    def put(self, entries: Mapping[str, list[list[int]]]) -> None:
        """Keep ``entries`` (key -> answers). A failure to write is logged, not raised: the answers are still
        kept for this run, and a later run asks the reference again."""
        if not entries:
            return
        self._entries.update({k: [list(map(int, a)) for a in v] for k, v in entries.items()})
        try:
            from filelock import FileLock  # a transformers dependency

            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=60):
                merged = {**self._read(), **self._entries}
                write_text_atomically(self.path, json.dumps({"format": FORMAT, "answers": merged},
                                                            separators=(",", ":")))
                self._read_mtime_ns = self._mtime_ns()
            self._entries = merged
        except Exception as exc:  # noqa: BLE001 - keeping answers is an optimisation; a check must not fail for it
            log.warning("gate: could not keep the reference's answers in %s (%s: %s); later runs will ask again",
                        self.path, type(exc).__name__, exc)

    def _mtime_ns(self) -> int | None:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return None

    def _read(self) -> dict[str, list[list[int]]]:
        self._read_mtime_ns = self._mtime_ns()
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            answers = data["answers"]
            if data.get("format") != FORMAT or not isinstance(answers, dict):
                raise ValueError(f"format {data.get('format')!r}")
            return {str(k): [list(map(int, a)) for a in v] for k, v in answers.items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = hidden_sibling(self.path, "bad")
            log.warning("gate: kept answers in %s are unreadable (%s: %s); set aside as %s and asked again",
                        self.path, type(exc).__name__, exc, aside.name)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return {}
