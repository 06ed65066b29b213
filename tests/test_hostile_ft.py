"""Hostile input for replica groups (fault tolerance): every new flag, environment variable, setting and
strategy option, through the real command line and plain ``python``, with the promises of
test_hostile_inputs.py (one ``multigpu: error: ... HINT: ...`` line, no traceback, non-zero exit,
nothing written outside the case folder, no process left, no planted command run).

Every case fails before anything listens: none starts a lighthouse or a torchft manager (which would
listen on every interface outside the tests' network namespace).
"""

from __future__ import annotations

import os

import pytest
from conftest import REPO, SCRIPTS
from test_hostile_inputs import (
    DIGITS,
    HANG_S,
    PWNED,
    Case,
    case_server,  # noqa: F401 - the fixture, shared
    test_hostile_input as run_case,
    write,
)

pytestmark = pytest.mark.timeout(120)
FT = {
    "REPLICA_GROUP_ID": "0",
    "NUM_REPLICA_GROUPS": "2",
    "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9",
}
INIT = "import multigpu as mg\nmg.init()\n"
#: A Trainer built with the given settings (it fails in its constructor, before any process group).
TRAINER = """import torch, multigpu as mg
from torch import nn
class T(mg.Trainer):
    def compute_loss(self, batch):
        return self.model(batch).sum()
run = mg.init()
T(run, nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), out_dir="out", {settings})
"""


def no_torchft(folder) -> None:
    """A script, and a torchft package that fails to import as a missing one would."""
    (folder / "s.py").write_text("")
    (folder / "torchft").mkdir()
    (folder / "torchft" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'torchft'\", name='torchft')\n"
    )


#: The case folder first on the path: its planted torchft package stands for one that is not installed.
HERE_FIRST = {"PYTHONPATH": os.pathsep.join([".", str(REPO / "src"), str(SCRIPTS)])}


def trainer(settings: str) -> object:
    return write("s.py", TRAINER.format(settings=settings))


S = write("s.py", "")

CASES = [
    # multigpu run: the replica-group flags
    Case(
        "run-replica-groups-0",
        ["run", "--replica-groups", "0", "s.py"],
        "--replica-groups 0 must be at least 1",
        S,
    ),
    Case(
        "run-replica-groups-huge",
        ["run", "--replica-groups", "99999", "s.py"],
        "more than 1,024",
        S,
    ),
    Case(
        "run-replica-groups-text",
        ["run", "--replica-groups", "two", "s.py"],
        "'two' is not a whole number",
        S,
    ),
    Case(
        "run-min-replicas-above",
        ["run", "--replica-groups", "2", "--min-replicas", "3", "s.py"],
        "--min-replicas 3 is more than 2",
        S,
    ),
    Case(
        "run-min-replicas-0",
        ["run", "--replica-groups", "2", "--min-replicas", "0", "s.py"],
        "--min-replicas 0 must be at least 1",
        S,
    ),
    Case(
        "run-heartbeat-0",
        ["run", "--replica-groups", "2", "--heartbeat-timeout", "0", "s.py"],
        "--heartbeat-timeout 0",
        S,
    ),
    Case(
        "run-heartbeat-nan",
        ["run", "--replica-groups", "2", "--heartbeat-timeout", "nan", "s.py"],
        "--heartbeat-timeout nan",
        S,
    ),
    Case(
        "run-heartbeat-huge",
        ["run", "--replica-groups", "2", "--heartbeat-timeout", "1e12", "s.py"],
        "must be 0.1 to 3600 seconds",
        S,
    ),
    Case(
        "run-replica-group-out-of-range",
        [
            "run",
            "--replica-groups",
            "2",
            "--replica-group",
            "2",
            "--lighthouse",
            "127.0.0.1:9",
            "s.py",
        ],
        "--replica-group 2 is more than 1",
        S,
    ),
    Case(
        "run-replica-group-without-lighthouse",
        ["run", "--replica-groups", "2", "--replica-group", "1", "s.py"],
        "go together",
        S,
    ),
    Case(
        "run-lighthouse-without-groups",
        ["run", "--lighthouse", "127.0.0.1:9", "s.py"],
        "belong to a job of --replica-groups",
        S,
    ),
    Case(
        "run-lighthouse-no-port",
        ["run", "--replica-groups", "2", "--replica-group", "0", "--lighthouse", "node1", "s.py"],
        "is not HOST:PORT",
        S,
    ),
    Case(
        "run-lighthouse-injection",
        [
            "run",
            "--replica-groups",
            "2",
            "--replica-group",
            "0",
            "--lighthouse",
            f"h;touch {PWNED}:1",
            "s.py",
        ],
        "is not HOST:PORT",
        S,
    ),
    Case(
        "run-replica-groups-with-nnodes",
        ["run", "--replica-groups", "2", "--nnodes", "2", "s.py"],
        "drop --nnodes",
        S,
    ),
    Case(
        "run-replica-groups-with-simulate",
        ["run", "--replica-groups", "2", "--simulate-nodes", "2", "s.py"],
        "drop --simulate-nodes",
        S,
    ),
    Case(
        "run-replica-groups-missing-script",
        ["run", "--replica-groups", "2", "nope.py"],
        "does not exist",
    ),
    Case(
        "run-replica-groups-too-many-procs",
        ["run", "--replica-groups", "1024", "--nproc", "8", "s.py"],
        "is more than 4,096",
        S,
    ),
    Case(
        "run-replica-groups-without-torchft",
        ["run", "--replica-groups", "2", "s.py"],
        "need torchft, which is not installed",
        no_torchft,
        env=HERE_FIRST,
    ),
    # the workers' environment (read by mg.init)
    Case(
        "env-replica-group-without-lighthouse",
        ["s.py"],
        "are set but TORCHFT_LIGHTHOUSE is not",
        write("s.py", INIT),
        env={"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2"},
        python=True,
    ),
    Case(
        "env-lighthouse-not-http",
        ["s.py"],
        "is not http://HOST:PORT",
        write("s.py", INIT),
        env={**FT, "TORCHFT_LIGHTHOUSE": "file:///etc/passwd"},
        python=True,
    ),
    Case(
        "env-lighthouse-injection",
        ["s.py"],
        "is not http://HOST:PORT",
        write("s.py", INIT),
        env={**FT, "TORCHFT_LIGHTHOUSE": f"http://h;touch {PWNED}:1"},
        python=True,
        fresh=True,
    ),
    Case(
        "env-replica-group-out-of-range",
        ["s.py"],
        "replica group 5 of 2",
        write("s.py", INIT),
        env={**FT, "REPLICA_GROUP_ID": "5"},
        python=True,
    ),
    Case(
        "env-replica-groups-missing",
        ["s.py"],
        "NUM_REPLICA_GROUPS is not set",
        write("s.py", INIT),
        env={"REPLICA_GROUP_ID": "0", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9"},
        python=True,
    ),
    Case(
        "env-min-replicas-text",
        ["s.py"],
        "MULTIGPU_MIN_REPLICAS='all' is not an integer",
        write("s.py", INIT),
        env={**FT, "MULTIGPU_MIN_REPLICAS": "all"},
        python=True,
    ),
    # the Trainer's fault_tolerance setting and the strategy
    Case(
        "trainer-fault-tolerance-without-launch",
        ["s.py"],
        "was not launched with replica groups",
        trainer("fault_tolerance={'replica_groups': 2}"),
        python=True,
    ),
    Case(
        "trainer-fault-tolerance-other-launch",
        ["s.py"],
        "launched with 2, at least 1",
        trainer("fault_tolerance={'replica_groups': 3}"),
        env=FT,
        python=True,
    ),
    Case(
        "trainer-fault-tolerance-text",
        ["s.py"],
        "fault_tolerance='yes' is invalid",
        trainer("fault_tolerance='yes'"),
        python=True,
    ),
    Case(
        "trainer-fault-tolerance-unknown-key",
        ["s.py"],
        "fault_tolerance has no setting 'replicas'",
        trainer("fault_tolerance={'replica_groups': 2, 'replicas': 2}"),
        python=True,
    ),
    Case(
        "trainer-fault-tolerance-min-above",
        ["s.py"],
        "min_replicas 3 is more than replica_groups 2",
        trainer("fault_tolerance={'replica_groups': 2, 'min_replicas': 3}"),
        python=True,
    ),
    Case(
        "hparams-fault-tolerance-zero",
        [DIGITS, "h.yaml"],
        "replica_groups=0",
        write("h.yaml", "trainer:\n  fault_tolerance: {replica_groups: 0}\n"),
        python=True,
    ),
    Case(
        "strategy-ft-timeout-negative",
        ["s.py"],
        "timeout_s -1.0 is outside",
        trainer("strategy_options={'timeout_s': -1}"),
        env=FT,
        python=True,
    ),
    Case(
        "strategy-ft-timeout-text",
        ["s.py"],
        "quorum_timeout_s must be float, not '1h'",
        trainer("strategy_options={'quorum_timeout_s': '1h'}"),
        env=FT,
        python=True,
    ),
    Case(
        "strategy-ft-unknown-option",
        ["s.py"],
        "has no option 'heal'",
        trainer("strategy_options={'heal': 1}"),
        env=FT,
        python=True,
    ),
    Case(
        "strategy-fsdp-in-replica-groups",
        ["s.py"],
        "cannot run in replica groups",
        trainer("strategy='fsdp'"),
        env=FT,
        python=True,
    ),
    Case(
        "strategy-ft-ddp-without-groups",
        ["s.py"],
        "needs replica groups",
        trainer("strategy='ft-ddp'"),
        python=True,
    ),
    # multigpu slurm --replica-groups
    Case(
        "slurm-replica-groups-not-nodes",
        ["slurm", "--dry-run", "--nodes", "2", "--replica-groups", "3", "s.py"],
        "each node runs one replica group",
        S,
    ),
    Case(
        "slurm-heartbeat-nan",
        [
            "slurm",
            "--dry-run",
            "--nodes",
            "2",
            "--replica-groups",
            "2",
            "--heartbeat-timeout",
            "nan",
            "s.py",
        ],
        "--heartbeat-timeout nan",
        S,
    ),
    Case(
        "slurm-min-replicas-above",
        [
            "slurm",
            "--dry-run",
            "--nodes",
            "2",
            "--replica-groups",
            "2",
            "--min-replicas",
            "5",
            "s.py",
        ],
        "--min-replicas 5 is more than 2",
        S,
    ),
    # the lighthouse host of a Slurm job
    Case(
        "lighthouse-bind-garbage",
        ["-m", "multigpu.launch.replicas", "--bind", "nowhere", "--replica-groups", "2"],
        "--bind 'nowhere' is not HOST:PORT",
        python=True,
    ),
]


def test_every_new_input_has_cases():
    ids = {c.id for c in CASES}
    assert len(ids) == len(CASES) >= 35
    for prefix in (
        "run-replica-groups",
        "run-min-replicas",
        "run-heartbeat",
        "run-replica-group-",
        "run-lighthouse",
        "env-",
        "trainer-fault-tolerance",
        "strategy-ft",
        "slurm-",
        "lighthouse-",
    ):
        assert any(i.startswith(prefix) for i in ids), prefix


@pytest.mark.timeout(HANG_S + 60)  # a case is killed at HANG_S, as in test_hostile_inputs.py
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_ft_input(case: Case, tmp_path, case_server):  # noqa: F811 - the imported fixture
    run_case(case, tmp_path, case_server)
