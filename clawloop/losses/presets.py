"""The objective's choices and method presets, and the checks of its settings (no torch here).

``clawloop.config`` reads its objective settings' allowed values, presets and checks from this module, so the
loss code and the settings cannot disagree about them. The checks raise ``ValueError`` naming the setting and
what it accepts; ``Config.validate`` turns that into a ``ConfigError`` with the same text.

Method presets: ``method`` decides the branch weights unless ``w_rl`` / ``w_opd`` are given explicitly; an
explicit weight that turns on a branch the preset turns off (e.g. ``method=rl`` with ``w_opd=1``) is an error.
``combine`` and ``topk_kl`` reproduce two of the original system's objectives (the sampled-token combination
and the top-k tail KL), which clawloop's contract keeps as presets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

METHODS = ("hybrid", "rl", "opd", "combine", "topk_kl")
HINT_SELECTIONS = ("sequence_optimal", "token_optimal", "shortest")
SUBSET_MODES = ("student", "teacher", "overlap")
OPD_ON_UNHINTED = ("skip", "anchor")
ADVANTAGE_MODES = ("raw", "baseline", "hinted_opd", "balanced")
SUPPORT_POSITIONS = ("all", "outside", "entropy")
# Which row of the teacher the distillation target follows per position (``losses.target_mix``).
OPD_TARGETS = ("hinted", "end", "opening_end")
# The methods whose OPD branch is top-k select, the surrogate the teacher-support term is added to.
SUPPORT_METHODS = ("hybrid", "opd")

# (w_rl, w_opd) each preset implies.
METHOD_WEIGHTS = {
    "hybrid": (1.0, 1.0),
    "rl": (1.0, 0.0),
    "opd": (0.0, 1.0),
    "combine": (1.0, 1.0),
    "topk_kl": (0.0, 1.0),
}


def check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    """ValueError naming the setting and its allowed values when ``value`` is not one of them."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of: {', '.join(allowed)}")


def method_weights(method: str, w_rl: float | None, w_opd: float | None) -> tuple[float, float]:
    """(w_rl, w_opd) after the method preset: a weight left as None takes the preset's."""
    preset_rl, preset_opd = METHOD_WEIGHTS[method]
    return float(preset_rl if w_rl is None else w_rl), float(preset_opd if w_opd is None else w_opd)


class ObjectiveChoices(Protocol):
    """The settings ``check_objective`` reads: ``clawloop.config.Config`` and ``ObjectiveSettings`` both have them."""

    method: str
    w_rl: float | None
    w_opd: float | None
    hint_selection: str
    subset_mode: str
    opd_on_unhinted: str
    eps_clip: float
    eps_clip_high: float
    kl_coef: float
    entropy_coef: float
    support_coef: float
    support_k: int
    support_positions: str
    support_min_entropy: float


def check_objective(settings: ObjectiveChoices) -> None:
    """The checks of the objective's settings: the choices, the weights against the method preset, the clip range,
    the KL / entropy coefficients and the teacher-support term. Raises ValueError naming the setting."""
    check_choice("method", settings.method, METHODS)
    check_choice("hint_selection", settings.hint_selection, HINT_SELECTIONS)
    check_choice("subset_mode", settings.subset_mode, SUBSET_MODES)
    check_choice("opd_on_unhinted", settings.opd_on_unhinted, OPD_ON_UNHINTED)
    for name, value in (("kl_coef", settings.kl_coef), ("entropy_coef", settings.entropy_coef)):
        if not value >= 0.0:
            raise ValueError(f"{name}={value!r} must be >= 0.0")
    if not 0.0 < settings.eps_clip < 1.0:
        raise ValueError(f"eps_clip={settings.eps_clip!r} must be in (0, 1)")
    if not 0.0 < settings.eps_clip_high <= 10.0:
        raise ValueError(f"eps_clip_high={settings.eps_clip_high!r} must be in (0, 10]")
    weights = (("w_rl", settings.w_rl), ("w_opd", settings.w_opd))
    for name, value in weights:
        if value is not None and not value >= 0:
            raise ValueError(f"{name}={value!r} must be >= 0")
    for (name, value), preset in zip(weights, METHOD_WEIGHTS[settings.method]):
        if value is not None and preset == 0.0 and value != 0.0:
            raise ValueError(
                f"{name}={value!r} contradicts method={settings.method!r}, which turns that branch off; "
                f"use method=hybrid to weight both branches")
    if method_weights(settings.method, settings.w_rl, settings.w_opd) == (0.0, 0.0):
        raise ValueError("w_rl and w_opd are both 0: nothing would be trained")
    check_support(settings)


def check_support(settings: ObjectiveChoices) -> None:
    """The teacher-support settings. The term belongs to the top-k select OPD branch: where a method trains none
    (rl, combine, topk_kl, or w_opd = 0) it has nothing to add to and stays out, like the other OPD settings."""
    check_choice("support_positions", settings.support_positions, SUPPORT_POSITIONS)
    coef = settings.support_coef
    if not (math.isfinite(coef) and coef >= 0.0):
        raise ValueError(f"support_coef={coef!r} must be a finite number >= 0.0")
    if isinstance(settings.support_k, bool) or int(settings.support_k) != settings.support_k \
            or settings.support_k < 1:
        raise ValueError(f"support_k={settings.support_k!r} must be an integer >= 1")
    if not (math.isfinite(settings.support_min_entropy) and settings.support_min_entropy >= 0.0):
        raise ValueError(f"support_min_entropy={settings.support_min_entropy!r} must be a finite number >= 0.0")


def support_active(settings: ObjectiveChoices) -> bool:
    """Whether the teacher-support term trains: a non-zero weight and a top-k select OPD branch to add it to."""
    if settings.support_coef == 0.0 or settings.method not in SUPPORT_METHODS:
        return False
    return method_weights(settings.method, settings.w_rl, settings.w_opd)[1] != 0.0
