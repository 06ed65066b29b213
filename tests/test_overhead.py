"""The Trainer's own collectives during training steps: at most one per ``stop_check_every`` steps
(the preemption agreement), and with the default (adaptive, about every 2 s) a handful per epoch.
Speed itself is measured by hand in benchmarks/peers.py, never asserted here."""

from __future__ import annotations

import json
import math

import pytest
from conftest import SCRIPTS, multigpu

# One 2-process launch of a small run per test (under a minute on 2 busy cores).
pytestmark = pytest.mark.timeout(180)


def _counts(tmp_path, *extra: str) -> list[dict]:
    multigpu(
        "run",
        "--nproc",
        "2",
        str(SCRIPTS / "collectives.py"),
        str(tmp_path),
        *extra,
        check=True,
        timeout=150,
    )
    return [json.loads((tmp_path / f"counts-rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("every", [1, 7])
def test_one_agreement_per_stop_check_every_steps_and_nothing_else(tmp_path, every):
    for record in _counts(tmp_path, "--every", str(every)):
        steps, counts = record["steps"], record["counts"]
        assert len(steps) == 80
        issued = counts[-1] - counts[0]
        allowed = math.ceil((steps[-1] - steps[0]) / every)
        assert issued <= allowed, (issued, allowed)
        # the counter sees the agreement: a check that cannot pass vacuously
        assert issued >= allowed - 1


def test_the_default_agreement_is_spaced_by_time_not_steps(tmp_path):
    """The agreement's clock reads 0.05 s per step (collectives.py --seconds-per-step): its ~2 s spacing is
    then 40 steps whatever the machine's load, where the wall clock made the count depend on it."""
    for record in _counts(tmp_path, "--seconds-per-step", "0.05"):
        issued = record["counts"][-1] - record["counts"][0]
        assert record["seconds"] == pytest.approx(80 * 0.05)  # epoch 2's 80 steps, on that clock
        assert issued <= 2 + math.ceil(record["seconds"] / 1.0), record
        assert issued < len(record["steps"]) / 4
        assert issued == 2  # 80 steps at one agreement per 2 s / 0.05 s = 40 steps
