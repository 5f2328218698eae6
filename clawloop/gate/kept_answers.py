"""The starting weights' answers to the shipped probes, kept on disk from one run to the next.

Besides the gate's probes, the retain term keeps its prompts' greedy answers here too (``clawloop.trainer.retain``;
keys named apart by a ``retain/N:`` before the prompt, N bumped when that module changes how it decodes), which
spares a later run the decoding of its targets.

The gate asks the fixed reference (the starting weights) each shipped and knowledge probe once per run, and draws
its sampled knowledge answers with up to ``gate_reference_dice`` sets of dice. Those answers depend on nothing a
run changes: the same weights, prompts, caps and dice give the same tokens. On the CPU default they took 23-67 s of
a run's first check and 130-170 s of the check that first needed the other dice (simulated runs of `brief`), work
every run repeated on the way to its first versions, and a restarted server repeated again.

``KeptAnswers`` is one JSON file per model, beside the converted models in the clawloop cache
(``$CLAWLOOP_CACHE/gate-answers/``). A file's name is a digest of what the answers depend on beyond one probe:

* the starting weights: the model folder's path, config, tokenizer and weight files, and the dtype and device kind
  the weights were loaded with (``weights_fingerprint``);
* the code that draws, decodes and stops the answers (``gate.py``, ``generation.py``, ``knowledge.py``, the
  engine's cache helpers) and the torch and transformers versions (``code_fingerprint``): a change to any of them
  starts a new file.

Inside, each entry's key is a digest of one probe's request: its text and prompt ids, answer cap, end-of-turn ids,
how many answers are sampled and at what temperature, the dice set, and the facts that end a sampled answer early.
Only the answers (token ids) are kept, never a verdict: the gate judges them afresh with its current rules, so a
change to the guard's rules (``guard.py``) needs no new file. Only shipped text is ever kept; the run's own prompts
(users' conversations) are not.

What is left out is what moves only float rounding: the machine's kernels, the thread count, the attention
implementation. Reusing an answer therefore decides as asking again would in exact arithmetic; an answer decoded
elsewhere may round differently, as answers already do between the gate's own batches (``probe_answers``). Writers
on one machine (several runs, test workers) merge their entries under a file lock and replace the file
atomically; a reader takes up another writer's entries when it misses one; a file that does not parse is set
aside by the next writer and started again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from clawloop.atomic import hidden_sibling, write_text_atomically
from clawloop.engines.model_files import cache_root

log = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when the file's layout or the meaning of a key changes."""

_CODE_FILES = ("gate/gate.py", "gate/generation.py", "gate/knowledge.py", "engines/hf.py")
"""The sources that decide which tokens an answer has and where it stops (relative to the package): the gate's
dice per answer and its early stop, the decoding loop, the facts' test, the engine's cache helpers."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
"""The tokenizer's files in a model folder: they decide the text an early stop reads."""


def cache_answers_root() -> Path:
    """``gate-answers`` in the clawloop cache (``$CLAWLOOP_CACHE``, else ``~/.cache/clawloop``)."""
    return cache_root() / "gate-answers"


answers_root: Callable[[], Path] = cache_answers_root
"""Where ``KeptAnswers.for_model`` keeps its files; the test suite points it at a folder of its own, so that tests
neither read answers kept on the machine nor leave theirs there."""


def weights_fingerprint(model_dir: str | Path, *, dtype: str, device_type: str) -> str:
    """A digest of the model folder (its path), its config, tokenizer and weight files, and how the weights were
    loaded. A weight file is named by its size, its modification time and its first and last MiB (a safetensors
    file's header lists every tensor's place): reading a 16 GB model byte for byte would cost a run tens of seconds,
    and a file rewritten in place gets a new modification time. The path is part of it so that two folders whose
    sampled bytes and times agree (copies of different merges made with their times kept) never share a file; a
    copy of one model elsewhere only starts a file of its own."""
    folder = Path(model_dir).resolve()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{folder}\0{dtype}\0{device_type}\0".encode())
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
    if not weights:
        raise FileNotFoundError(f"no weight files in {folder}")
    digest.update((folder / "config.json").read_bytes())
    for name in _TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(f"\0{name}\0".encode() + (folder / name).read_bytes())
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
        self._read_stamp: tuple[int, int, int] | None = None
        self._entries: dict[str, list[list[int]]] = self._read()

    @classmethod
    def for_model(cls, model_dir: str | Path, *, dtype: str, device_type: str,
                  root: str | Path | None = None) -> KeptAnswers:
        """The file of the starting weights in ``model_dir`` (``root``: the folder of such files, by default
        ``answers_root()``)."""
        if root is None:
            root = answers_root()
        name = hashlib.blake2b(f"{weights_fingerprint(model_dir, dtype=dtype, device_type=device_type)}\0"
                               f"{code_fingerprint()}".encode(), digest_size=16).hexdigest()
        return cls(Path(root) / f"{name}.json")

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> list[list[int]] | None:
        """The answers kept under ``key``; on a miss, the file is read again if another writer (a run beside this
        one) has replaced it since."""
        found = self._entries.get(key)
        if found is None and self._stamp() != self._read_stamp:
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
                merged = {**self._read(set_aside=True), **self._entries}
                write_text_atomically(self.path, json.dumps({"format": FORMAT, "answers": merged},
                                                            separators=(",", ":")))
                self._read_stamp = self._stamp()
            self._entries = merged
        except Exception as exc:  # noqa: BLE001 - keeping answers is an optimisation; a check must not fail for it
            log.warning("gate: could not keep the reference's answers in %s (%s: %s); later runs will ask again",
                        self.path, type(exc).__name__, exc)

    def _stamp(self) -> tuple[int, int, int] | None:
        """The file's inode, size and modification time: every atomic replace makes a new inode, so a write is
        seen even where two land within one tick of the file system's clock."""
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_size, stat.st_mtime_ns

    def _read(self, *, set_aside: bool = False) -> dict[str, list[list[int]]]:
        """The file's entries; none where it is missing or cannot be read. A file that reads but does not parse
        is set aside only by a writer (``set_aside``, under the lock), so a reader never moves a file another
        writer has just replaced."""
        self._read_stamp = self._stamp()
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("gate: kept answers in %s cannot be read (%s: %s); asked again", self.path,
                        type(exc).__name__, exc)
            return {}
        try:
            data = json.loads(text)
            answers = data["answers"]
            if data.get("format") != FORMAT or not isinstance(answers, dict):
                raise ValueError(f"format {data.get('format')!r}")
            return {str(k): [list(map(int, a)) for a in v] for k, v in answers.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if not set_aside:
                log.warning("gate: kept answers in %s are unreadable (%s: %s); asked again", self.path,
                            type(exc).__name__, exc)
                return {}
            aside = hidden_sibling(self.path, "bad")
            log.warning("gate: kept answers in %s are unreadable (%s: %s); set aside as %s and started again",
                        self.path, type(exc).__name__, exc, aside.name)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return {}
