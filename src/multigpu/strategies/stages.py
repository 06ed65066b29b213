"""Recipe stages (prepare -> train -> evaluate ...) run from ``start_stage`` to ``end_stage``.

Why: the multi-GPU guide of ASDF (an audio anti-spoofing framework) runs recipes in numbered stages so
that a family of runs can share data preparation, or re-evaluate without retraining. A recipe lists its
stages once; the config picks the range by name or by number, and a wrong name is an error, not a
silent no-op. Numbers count from 0 as in ASDF's recipes (``recipe.start_stage = 5`` there is the sixth
stage), so a value copied from an ASDF config selects the same stage; ``first=1`` numbers them from 1
(ESPnet's and Kaldi's ``--stage 1``) where a recipe's users expect that. Names are the same either way.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

from multigpu import validate
from multigpu.errors import ConfigError

StageRef = Union[str, int, None]


class Stages:
    def __init__(
        self, names: Sequence[str], start: StageRef = None, end: StageRef = None, first: int = 0
    ) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError("stage names must be unique and at least one")
        if first not in (0, 1):
            raise ValueError("stages are numbered from 0 (ASDF) or 1")
        self.names = list(names)
        self.first = first
        self.start = self._index(start, "start_stage", default=0)
        self.end = self._index(end, "end_stage", default=len(self.names) - 1)
        if self.start > self.end:
            raise ConfigError(
                f"start_stage {self.names[self.start]!r} comes after end_stage {self.names[self.end]!r}.",
                f"the stages run in this order: {' -> '.join(self.names)}.",
            )

    def _index(self, ref: StageRef, setting: str, default: int) -> int:
        if ref is None or ref == "":
            return default
        if isinstance(ref, int) or validate.is_digits(ref):
            number = int(ref)
            if not self.first <= number < len(self.names) + self.first:
                raise ConfigError(
                    f"{setting}={number} is not a stage: they are numbered "
                    f"{self.first}..{len(self.names) - 1 + self.first}.",
                    f"stages: {', '.join(f'{i + self.first}={n}' for i, n in enumerate(self.names))}.",
                )
            return number - self.first
        if ref not in self.names:
            raise ConfigError(
                f"{setting}={ref!r} is not a stage of this recipe.",
                f"choose from: {', '.join(self.names)}.",
            )
        return self.names.index(ref)

    @property
    def selected(self) -> list[str]:
        return self.names[self.start : self.end + 1]

    def __contains__(self, name: object) -> bool:
        if name not in self.names:
            raise ConfigError(
                f"{name!r} is not a stage of this recipe.", f"stages: {', '.join(self.names)}."
            )
        return self.start <= self.names.index(name) <= self.end

    def run(
        self,
        functions: Mapping[str, Callable[[], object]],
        announce: Optional[Callable[[str], None]] = None,
    ) -> dict[str, Any]:
        """Call the selected stages in order; returns ``{stage: result}``."""
        missing = [n for n in self.names if n not in functions]
        if missing:
            raise ValueError(f"no function for stage(s) {missing}")
        results = {}
        for name in self.selected:
            if announce is not None:
                announce(
                    f"stage {self.names.index(name) + self.first} ({name}) of "
                    f"{self.first}..{len(self.names) - 1 + self.first}"
                )
            results[name] = functions[name]()
        return results
