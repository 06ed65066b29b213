"""The gold standard: N processes x batch b end with the parameters of 1 process x batch N*b,
for every strategy.

Every case trains 6 optimizer steps per epoch for 2 epochs (a reshuffle in between) with real gloo
processes and compares against one plain process. A negative control shows the comparison can fail.

Launches are shared (a launch costs ~5 s of two cores, a case a fraction of a second): one 2-process
launch per strategy trains that strategy's cases one after the other, each from scratch with every
random stream seeded as a fresh process's (tests/scripts/equivalence.py ``--plan``), so each strategy's
first case still runs in a process of its own and the others in a process that already ran one - which
several runs in one process must allow anyway. The single-process references share one launch too, with
the pipeline strategy's one-process runs after them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, leftovers_checked, multigpu

# The first test of each strategy pays its shared launch, the very first the references' launch too (each
# 20-40 s on 2 busy cores, each capped at 240 s by _train_all): 600 s covers both on a loaded machine; a
# hang (a rank waiting on a collective) still ends here.
pytestmark = pytest.mark.timeout(600)
SCRIPT = str(SCRIPTS / "equivalence.py")
GLOBAL = 8
CASES = {
    "plain": [],
    "accumulation": ["--accumulate", "3"],
    "clipping": ["--clip", "0.05", "--optimizer", "sgd"],
}
#: Each strategy's (case, mode) pairs: one launch per strategy trains all of them.
PARALLEL = {
    "ddp": [
        ("plain", "trainer"),
        ("plain", "loop"),
        ("accumulation", "trainer"),
        ("accumulation", "loop"),
        ("clipping", "trainer"),
        ("clipping", "loop"),
    ],
    "fsdp": [
        ("plain", "trainer"),
        ("accumulation", "trainer"),
        ("clipping", "trainer"),
        ("plain", "loop"),
    ],
    "ddp+pipeline": [("plain", "trainer"), ("accumulation", "trainer"), ("clipping", "trainer")],
}
#: float64 runs that differ only in the order of float sums: at most ~1e-8 apart after 12 AdamW steps
#: (see tests/scripts/equivalence.py for the bound); 1e-7 leaves a factor of 10 over that worst case,
#: while a real difference (another global batch, a missing all-reduce) is above 1e-3.
TOLERANCE = 1e-7


def _train_all(folder: Path, nproc: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    """One launch of ``nproc`` processes training every run of ``runs`` (name -> arguments) in turn."""
    plan = [
        [str(folder / f"{name}.pt"), "--global-batch", str(GLOBAL), *args]
        for name, args in runs.items()
    ]
    (folder / "plan.json").write_text(json.dumps(plan))
    with leftovers_checked() as token:
        # A launch trains up to 7 cases of 12 steps: seconds each; 240 s is for a loaded machine.
        multigpu(
            "run",
            "--nproc",
            str(nproc),
            SCRIPT,
            "--plan",
            str(folder / "plan.json"),
            token,
            check=True,
            timeout=240,
        )
    return {name: torch.load(folder / f"{name}.pt", weights_only=True) for name in runs}


def _max_diff(a, b, losses=True):
    """The largest difference of any weight, or of any step's global loss."""
    assert a["weights"].keys() == b["weights"].keys()
    weights = max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])
    if not losses:
        return weights
    assert len(a["losses"]) == len(b["losses"]) > 0
    return max(weights, (a["losses"] - b["losses"]).abs().max().item())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, dict]:
    """One plain process with the global batch, per case, and "init": the parameters after zero steps
    (proves that the runs below actually trained); and "piped-CASE": the pipeline strategy in one process
    (stages in sequence). One launch, shared by every strategy."""
    runs = {case: ["--batch", str(GLOBAL), *args] for case, args in CASES.items()}
    runs["init"] = ["--batch", str(GLOBAL), "--epochs", "0"]
    for case in ("plain", "accumulation"):
        runs[f"piped-{case}"] = ["--batch", str(GLOBAL), *CASES[case], "--strategy", "pipeline"]
    return _train_all(tmp_path_factory.mktemp("single"), 1, runs)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    """``get(strategy)``: every (case, mode) of that strategy on 2 processes with half the batch each, from
    one launch; for ddp also "doubled", the negative control (2 processes with the single run's batch)."""
    cache: dict[str, dict[str, dict]] = {}

    def get(strategy: str) -> dict[str, dict]:
        if strategy not in cache:
            runs = {
                f"{case}-{mode}": [
                    "--batch",
                    str(GLOBAL // 2),
                    *CASES[case],
                    "--mode",
                    mode,
                    "--strategy",
                    strategy,
                ]
                for case, mode in PARALLEL[strategy]
            }
            if strategy == "ddp":
                runs["doubled"] = ["--batch", str(GLOBAL)]
            cache[strategy] = _train_all(
                tmp_path_factory.mktemp(strategy.replace("+", "-")), 2, runs
            )
        return cache[strategy]

    return get


@pytest.mark.parametrize(
    "strategy, case, mode", [(s, c, m) for s, pairs in PARALLEL.items() for c, m in pairs]
)
def test_two_processes_equal_one_process_with_the_global_batch(
    single, parallel, strategy, case, mode
):
    reference = single[case]
    assert _max_diff(parallel(strategy)[f"{case}-{mode}"], reference) < TOLERANCE
    assert _max_diff(reference, single["init"], losses=False) > 1e-2  # it trained


@pytest.mark.parametrize("case", ["plain", "accumulation"])
def test_pipeline_in_one_process_equals_the_unsplit_model(single, case):
    """The pipeline strategy in one process (stages in sequence) trains what the unsplit model trains."""
    assert _max_diff(single[f"piped-{case}"], single[case]) < TOLERANCE


def test_negative_control_a_different_global_batch_does_not_match(single, parallel):
    """2 processes with the single run's batch (so the global batch doubles) must differ: the check can fail.
    Half as many steps, so the loss sequences differ in length; the weights are compared."""
    doubled = parallel("ddp")["doubled"]
    assert len(doubled["losses"]) == len(single["plain"]["losses"]) // 2
    assert _max_diff(doubled, single["plain"], losses=False) > 1e-3
