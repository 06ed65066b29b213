"""The gold standard: N processes x batch b end with the parameters of 1 process x batch N*b,
for every strategy.

Every case trains 6 optimizer steps per epoch for 2 epochs (a reshuffle in between) with real gloo
processes and compares against one plain process. A negative control shows the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SCRIPTS, multigpu

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "equivalence.py")
GLOBAL = 8
CASES = {
    "plain": [],
    "accumulation": ["--accumulate", "3"],
    "clipping": ["--clip", "0.05", "--optimizer", "sgd"],
}
#: float64 runs that differ only in the order of float sums: at most ~1e-8 apart after 12 AdamW steps
#: (see tests/scripts/equivalence.py for the bound); 1e-7 leaves a factor of 10 over that worst case,
#: while a real difference (another global batch, a missing all-reduce) is above 1e-3.
TOLERANCE = 1e-7


def _train(folder, name, nproc, batch, extra):
    out = folder / f"{name}.pt"
    multigpu("run", "--nproc", str(nproc), SCRIPT, str(out), "--batch", str(batch), "--global-batch", str(GLOBAL),
             *extra, check=True)
    return torch.load(out, weights_only=True)


def _max_diff(a, b, losses=True):
    """The largest difference of any weight, or of any step's global loss."""
    assert a["weights"].keys() == b["weights"].keys()
    weights = max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"])
    if not losses:
        return weights
    assert len(a["losses"]) == len(b["losses"]) > 0
    return max(weights, (a["losses"] - b["losses"]).abs().max().item())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One plain process with the global batch, per case (computed once, shared by the strategies)."""
    folder = tmp_path_factory.mktemp("single")
    cache: dict[str, dict] = {}

    def get(case: str) -> dict:
        if case not in cache:
            cache[case] = _train(folder, case, 1, GLOBAL, CASES[case])
        return cache[case]

    return get


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    """Parameters after zero steps: proves that the runs below actually trained."""
    return _train(tmp_path_factory.mktemp("init"), "init", 1, GLOBAL, ["--epochs", "0"])


@pytest.mark.parametrize(
    "strategy, case, mode",
    [
        ("ddp", "plain", "trainer"), ("ddp", "plain", "loop"),
        ("ddp", "accumulation", "trainer"), ("ddp", "accumulation", "loop"),
        ("ddp", "clipping", "trainer"), ("ddp", "clipping", "loop"),
        ("fsdp", "plain", "trainer"), ("fsdp", "accumulation", "trainer"), ("fsdp", "clipping", "trainer"),
        ("fsdp", "plain", "loop"),
        ("ddp+pipeline", "plain", "trainer"), ("ddp+pipeline", "accumulation", "trainer"),
        ("ddp+pipeline", "clipping", "trainer"),
    ],
)
def test_two_processes_equal_one_process_with_the_global_batch(tmp_path, single, initial, strategy, case, mode,
                                                                no_leftovers):
    reference = single(case)
    parallel = _train(tmp_path, "parallel", 2, GLOBAL // 2,
                      [*CASES[case], "--mode", mode, "--strategy", strategy, "--tokens", no_leftovers])
    assert _max_diff(parallel, reference) < TOLERANCE
    assert _max_diff(reference, initial, losses=False) > 1e-2  # it trained


@pytest.mark.parametrize("case", ["plain", "accumulation"])
def test_pipeline_in_one_process_equals_the_unsplit_model(tmp_path, single, case, no_leftovers):
    piped = _train(tmp_path, "piped", 1, GLOBAL, [*CASES[case], "--strategy", "pipeline", "--tokens", no_leftovers])
    assert _max_diff(piped, single(case)) < TOLERANCE


def test_negative_control_a_different_global_batch_does_not_match(tmp_path, single, no_leftovers):
    """2 processes with the single run's batch (so the global batch doubles) must differ: the check can fail."""
    doubled = _train(tmp_path, "doubled", 2, GLOBAL, ["--tokens", no_leftovers])
    assert _max_diff(doubled, single("plain"), losses=False) > 1e-3
