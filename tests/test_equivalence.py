"""The gold standard: N processes x batch b end with the parameters of 1 process x batch N*b.

Every case trains >= 6 optimizer steps per epoch for 2 epochs (a reshuffle in between) with 2 real
gloo processes, and compares against one process. A negative control shows the comparison can fail.
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


def _train(tmp_path, name, nproc, batch, extra, token):
    out = tmp_path / f"{name}.pt"
    multigpu("run", "--nproc", str(nproc), SCRIPT, str(out), "--batch", str(batch), "--global-batch", str(GLOBAL),
             "--tokens", token, *extra, check=True)
    return torch.load(out, weights_only=True)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    """Parameters after zero steps: proves that the runs below actually trained."""
    tmp = tmp_path_factory.mktemp("init")
    return _train(tmp, "init", 1, GLOBAL, ["--epochs", "0"], "init")


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_equal_one_process_with_the_global_batch(tmp_path, case, initial, no_leftovers):
    extra = CASES[case]
    reference = _train(tmp_path, "single", 1, GLOBAL, extra, no_leftovers)
    for mode in ("trainer", "loop"):
        parallel = _train(tmp_path, f"ddp-{mode}", 2, GLOBAL // 2, [*extra, "--mode", mode], no_leftovers)
        assert _max_diff(parallel, reference) < 1e-6, mode
    assert _max_diff(reference, initial) > 1e-2  # it trained


def test_negative_control_a_different_global_batch_does_not_match(tmp_path, no_leftovers):
    """2 processes with the *single* run's batch (global batch doubled) must differ: the check can fail."""
    reference = _train(tmp_path, "single", 1, GLOBAL, [], no_leftovers)
    doubled = _train(tmp_path, "doubled", 2, GLOBAL, [], no_leftovers)  # batch 8 per process: global 16
    assert _max_diff(doubled, reference) > 1e-3
