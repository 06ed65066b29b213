"""torchrun's command lines, with ``torchrun`` replaced by ``multigpu run``: taken with torchrun's meaning
or refused with one line that says why and what to use. The lines are copied from PyTorch's torchrun
documentation, the PyTorch DDP tutorial series and SpeechBrain's multi-GPU guide (placeholders such as
$NUM_TRAINERS filled in, host names replaced by loopback addresses). Planned, not launched: the
launch itself is tested in test_launch_real.py.
"""

from __future__ import annotations

import shlex

import pytest

from multigpu.cli import build_parser
from multigpu.commands.launching import plan_run
from multigpu.errors import MultiGPUError

FILL = {
    "$NUM_TRAINERS": "2",
    "$NUM_NODES": "2",
    "$JOB_ID": "job7",
    "$HOST_NODE_ADDR": "127.0.0.1:29400",
}

#: (where the line comes from, the line, what the plan must be: nproc, cpu, rendezvous backend,
#: endpoint, min nodes, max nodes, node rank, max restarts)
ACCEPTED = [
    (
        "torchrun docs, single node",
        "torchrun --standalone --nnodes=1 --nproc-per-node=$NUM_TRAINERS YOUR_TRAINING_SCRIPT.py",
        (2, "c10d", "localhost:0", 1, 1, 0, 0),
    ),
    (
        "torchrun docs, single node with a c10d endpoint",
        "torchrun --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --nnodes=1"
        " --nproc-per-node=$NUM_TRAINERS YOUR_TRAINING_SCRIPT.py",
        (2, "c10d", "localhost:0", 1, 1, 0, 0),
    ),
    (
        "torchrun docs, fault tolerant",
        "torchrun --nnodes=$NUM_NODES --nproc-per-node=$NUM_TRAINERS --max-restarts=3 --rdzv-id=$JOB_ID "
        "--rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR YOUR_TRAINING_SCRIPT.py",
        (2, "c10d", "127.0.0.1:29400", 2, 2, 0, 3),
    ),
    (
        "torchrun docs, elastic",
        "torchrun --nnodes=1:4 --nproc-per-node=$NUM_TRAINERS --max-restarts=3 --rdzv-id=$JOB_ID --rdzv-backend=c10d "
        "--rdzv-endpoint=$HOST_NODE_ADDR YOUR_TRAINING_SCRIPT.py",
        (2, "c10d", "127.0.0.1:29400", 1, 4, 0, 3),
    ),
    (
        "PyTorch DDP tutorial series, multinode",
        "torchrun --nproc_per_node=4 --nnodes=2 --node_rank=0 --rdzv_id=456 --rdzv_backend=c10d "
        "--rdzv_endpoint=172.31.43.139:29603 multinode.py 50 10",
        (4, "c10d", "172.31.43.139:29603", 2, 2, 0, 0),
    ),
    (
        "PyTorch DDP tutorial, one machine",
        "torchrun --nproc_per_node=2 multigpu_torchrun.py 50 10",
        (2, "c10d", "localhost:0", 1, 1, 0, 0),
    ),
    (
        "SpeechBrain's multi-GPU guide, one machine",
        "torchrun --nproc_per_node=4 experiment.py hyperparams.yaml",
        (4, "c10d", "localhost:0", 1, 1, 0, 0),
    ),
    (
        "SpeechBrain's multi-GPU guide, two machines (second node)",
        "torchrun --nproc_per_node=2 --nnodes=2 --node_rank=1 --master_addr 127.0.0.1 --master_port 5555 train.py "
        "hparams/myrecipe.yaml",
        (2, "static", "127.0.0.1:5555", 2, 2, 1, 0),
    ),
    (
        "torchrun's own spellings of the rest",
        "torchrun --standalone --nproc_per_node=2 --monitor_interval=1 --role trainer --start_method spawn --run_path "
        "--log_dir LOGS --max_restarts 1 --rdzv_conf join_timeout=600 train.py",
        (2, "c10d", "localhost:0", 1, 1, 0, 1),
    ),
    (
        "a static rendezvous named by its endpoint",
        "torchrun --nnodes 2 --node-rank 1 --rdzv-backend static --rdzv-endpoint 127.0.0.1:5556 --nproc-per-node 2 train.py",
        (2, "static", "127.0.0.1:5556", 2, 2, 1, 0),
    ),
]

REFUSED = [
    (
        "torchrun --redirects 3 --log-dir LOGS train.py",
        "--redirects is not a multigpu run flag",
        "--log-dir",
    ),
    ("torchrun -r 3 train.py", "-r is not a multigpu run flag", "--log-dir"),
    ("torchrun --tee 3 train.py", "--tee is not a multigpu run flag", "--log-dir"),
    ("torchrun -t 3 train.py", "-t is not a multigpu run flag", "--log-dir"),
    ("torchrun --no-python train.py", "--no-python is not a multigpu run flag", "Python scripts"),
    ("torchrun --no_python train.py", "--no_python is not a multigpu run flag", "Python scripts"),
    ("torchrun --local-ranks-filter 0 train.py", "--local-ranks-filter is not", "grep"),
    ("torchrun --logs-specs mine train.py", "--logs-specs is not", "plugin"),
    ("torchrun --numa-binding node train.py", "--numa-binding is not", "numactl"),
    ("torchrun --signals-to-handle SIGTERM train.py", "--signals-to-handle is not", "SIGUSR1"),
    (
        "torchrun --virtual-local-rank train.py",
        "--virtual-local-rank is not",
        "CUDA_VISIBLE_DEVICES",
    ),
    (
        "torchrun --rdzv-backend=etcd --rdzv-endpoint=127.0.0.1:2379 train.py",
        "etcd rendezvous needs an etcd server",
        "c10d",
    ),
    ("torchrun --start-method fork train.py", "spawn only", "fresh interpreter"),
    (
        "torchrun --standalone --nnodes 2 train.py",
        "--standalone is one machine",
        "drop --standalone",
    ),
    (
        "torchrun --rdzv-conf read_timeout=60 train.py",
        "join_timeout=SECONDS only",
        "--rdzv-timeout",
    ),
    ("torchrun --nproc-per-node=xpu train.py", "is not a number of processes", "--help"),
]


def _parse(line: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hparams").mkdir(exist_ok=True)
    for script in (
        "YOUR_TRAINING_SCRIPT.py",
        "multinode.py",
        "multigpu_torchrun.py",
        "experiment.py",
        "train.py",
    ):
        (tmp_path / script).write_text("")
    for placeholder, value in FILL.items():
        line = line.replace(placeholder, value)
    argv = shlex.split(line)
    assert argv[0] == "torchrun"
    return build_parser().parse_args(["run", *argv[1:]])


@pytest.mark.parametrize("source, line, expected", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_torchrun_lines_are_taken_with_torchruns_meaning(
    source, line, expected, tmp_path, monkeypatch
):
    nproc, backend, endpoint, min_nodes, max_nodes, node_rank, restarts = expected
    request = plan_run(_parse(line, tmp_path, monkeypatch))
    rdzv = request.rendezvous
    assert (
        request.devices.nproc,
        rdzv.backend,
        rdzv.min_nodes,
        rdzv.max_nodes,
        rdzv.node_rank,
        request.max_restarts,
    ) == (nproc, backend, min_nodes, max_nodes, node_rank, restarts)
    assert rdzv.endpoint == endpoint
    assert request.command[0].endswith(".py")


def test_torchruns_extra_flags_keep_their_meaning(tmp_path, monkeypatch):
    line = ACCEPTED[8][1]
    request = plan_run(_parse(line, tmp_path, monkeypatch))
    assert (request.monitor_interval, request.role, request.rendezvous.timeout_s) == (
        1.0,
        "trainer",
        600,
    )
    assert request.log_dir == "LOGS"


@pytest.mark.parametrize("line, message, hint", REFUSED)
def test_torchrun_flags_multigpu_does_not_take_are_one_line_with_a_reason(
    line, message, hint, tmp_path, monkeypatch, capsys
):
    try:
        plan_run(_parse(line, tmp_path, monkeypatch))
    except MultiGPUError as exc:
        text = exc.one_line()
    # argparse's refusal of a value: our Parser prints the one line and exits 2
    except SystemExit as exc:
        assert exc.code == 2
        text = capsys.readouterr().err.strip()
    else:
        pytest.fail(f"{line!r} was accepted")
    assert (
        text.startswith("multigpu: error:") and message in text and "HINT:" in text and hint in text
    )
    assert "\n" not in text


def test_abbreviations_are_never_read_as_another_flag(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parse("torchrun --tee-pre always train.py", tmp_path, monkeypatch)
    assert "unrecognized arguments: --tee-pre" in capsys.readouterr().err


def test_a_refused_torchrun_flag_is_a_refusal_exit_2(capsys):
    """Through the command's own entry point: the status of every refused input (docs/fault-tolerance.md)."""
    from multigpu import cli

    assert cli.main(["run", "--tee", "3", "train.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("multigpu: error: torchrun's --tee") and "HINT:" in err and "\n" not in err
    )


@pytest.mark.parametrize(
    "line, hint",
    [
        ("accelerate launch --num_processes 2 train.py", "launch is multigpu run here"),
        (
            "multigpu run --num_processes 2 train.py",
            "--num_processes is multigpu run --nproc N here",
        ),
        ("multigpu run --mixed_precision bf16 train.py", "trainer.precision=bf16"),
        (
            "multigpu run --config_file accelerate.yaml train.py",
            "the recipe's YAML file after the script",
        ),
    ],
)
def test_a_flag_of_accelerate_is_one_line_naming_ours(line, hint, capsys):
    from multigpu import cli

    # argparse's refusals leave through our Parser.error, status 2
    with pytest.raises(SystemExit) as exited:
        cli.main(shlex.split(line)[1:])  # `accelerate launch ...` typed as `multigpu launch ...`
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("multigpu: error:")
        and "multigpu: error: multigpu:" not in err
        and hint in err
    ), err
    assert "\n" not in err


# ------------------------------------------------- a recipe's arguments, checked before any worker starts

RECIPE = """\
from dataclasses import dataclass, field
import multigpu as mg
from multigpu import config

@dataclass
class Recipe:
    lr: float = 0.1
    trainer: mg.TrainerSettings = field(default_factory=mg.TrainerSettings)

cfg = config.load(Recipe, "h.yaml")
"""


@pytest.fixture
def no_launch(monkeypatch):
    """``multigpu run`` that records instead of starting workers: what reaches the launcher."""
    import multigpu.launch.local as local

    started: list[tuple[str, ...]] = []
    monkeypatch.setattr(local, "launch", lambda request: started.append(request.command) or 0)
    return started


@pytest.mark.parametrize(
    "args, said",
    [
        (
            ["h.yaml", "trainer.epoch=1"],
            "unknown key 'trainer.epoch'. HINT: did you mean 'trainer.epochs'?",
        ),
        (["h.yaml", "trainer.epochs=x"], "trainer.epochs must be int"),
        (["h.yaml", "+trainer.epochs=1"], "Hydra's + adds a key"),
        (["h.yaml", "~trainer.epochs"], "Hydra's ~ deletes a key"),
        (["h.yaml", "lr=1e-3", "--multirun"], "Hydra's sweep switch"),
        (["bad.yaml"], "bad.yaml"),
        (["h.yaml"], "h.yaml:2: unknown key 'trainer.epoch'"),
    ],
)
def test_a_recipes_typo_is_refused_before_any_worker_imports_torch(
    tmp_path, monkeypatch, capsys, no_launch, args, said
):
    """Issue 52, item 9: each of these waited 4-12 s for every rank's `import torch` before its one line."""
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(RECIPE)
    (tmp_path / "h.yaml").write_text(
        "lr: 0.1\ntrainer: {epochs: 2}\n" if args != ["h.yaml"] else "trainer:\n  epoch: 2\n"
    )
    (tmp_path / "bad.yaml").write_text("trainer: {epochs: 2\n")
    assert cli.main(["run", "train.py", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("multigpu: error:") and said in err and "HINT:" in err and "\n" not in err
    ), err
    assert no_launch == []


@pytest.mark.parametrize(
    "script, args",
    [
        # model.*: the script's own class says
        (RECIPE, ["h.yaml", "trainer.epochs=3", "lr=1e-3", "model.width=9"]),
        # not a recipe of ours
        ("import argparse\nargparse.ArgumentParser().parse_args()\n", ["h.yaml", "+x=1"]),
        # flags of its own: its arguments are its own
        (RECIPE, ["h.yaml", "--epochs", "3", "trainer.epoch=1"]),
    ],
)
def test_arguments_the_launcher_cannot_judge_reach_the_script(
    tmp_path, monkeypatch, no_launch, script, args
):
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(script)
    (tmp_path / "h.yaml").write_text("lr: 0.1\n")
    assert cli.main(["run", "--nproc", "1", "train.py", *args]) == 0
    assert no_launch == [("train.py", *args)]


def test_fresh_and_resume_are_the_recipes_own_settings(tmp_path, monkeypatch, capsys, no_launch):
    """`--fresh` / `--resume PATH` (issue 52): the recipe's trainer.fresh / trainer.resume_from, written so its
    override parser reads the path back as the same text; refused with a line where no recipe reads them."""
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(RECIPE)
    (tmp_path / "h.yaml").write_text("lr: 0.1\n")
    (tmp_path / "own.py").write_text("import torch\n")
    assert cli.main(["run", "--fresh", "train.py", "h.yaml"]) == 0
    assert cli.main(["run", "--resume", "runs/a: b", "train.py", "h.yaml", "lr=1"]) == 0
    assert no_launch == [
        ("train.py", "h.yaml", "trainer.fresh=true"),
        ("train.py", "h.yaml", "lr=1", "trainer.resume_from='runs/a: b'"),
    ]
    for line, said in (
        (["run", "--fresh", "own.py"], "reads none this launcher can find"),
        (["run", "--fresh", "--resume", "x", "train.py"], "give one of them"),
        (["run", "--resume", "x", "-m", "pkg.train"], "a module run with -m"),
    ):
        assert cli.main(line) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("multigpu: error:") and said in err and "HINT:" in err, err
    assert len(no_launch) == 2


def test_resume_paths_yaml_misreads_and_scripts_too_deep_to_parse_are_no_traceback(
    tmp_path, monkeypatch, no_launch
):
    """Fresh-eyes findings: `--resume 2020-13-45` (YAML reads a bad date) and a script nested deeper than
    ast.unparse recurses ended in a traceback; each now reaches the launcher as the user wrote it."""
    from multigpu import cli
    from multigpu.config import parse_overrides

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(RECIPE)
    (tmp_path / "h.yaml").write_text("lr: 0.1\n")
    for path in ("2020-13-45", "2020-02-30 25:00:00", "!!float abc"):
        assert cli.main(["run", "--resume", path, "train.py", "h.yaml"]) == 0
        assert parse_overrides([no_launch[-1][-1]]) == {"trainer.resume_from": path}
    deep = "import multigpu as mg\nfrom multigpu import config\n" + "a" + ".b" * 500 + ".load(R)\n"
    (tmp_path / "deep.py").write_text(deep)
    # left to the script, which says what is wrong
    assert cli.main(["run", "deep.py", "trainer.epoch=1"]) == 0
    assert no_launch[-1] == ("deep.py", "trainer.epoch=1")


@pytest.mark.parametrize(
    "source, refused",
    [
        (RECIPE, True),
        # a class of the user's own, or of another library, named TrainerSettings: its keys are its own
        (
            RECIPE.replace("mg.TrainerSettings", "TrainerSettings").replace(
                "@dataclass\nclass Recipe",
                "@dataclass\nclass TrainerSettings:\n    epoch: int = 1\n\n@dataclass\nclass Recipe",
            ),
            False,
        ),
        (
            RECIPE.replace("mg.TrainerSettings", "other.TrainerSettings").replace(
                "import multigpu as mg", "import multigpu as mg\nimport other"
            ),
            False,
        ),
        # two recipes loaded: which one reads these arguments is the script's to say
        (
            RECIPE + "\n@dataclass\nclass Other:\n    trainer: dict = None\n\nconfig.load(Other)\n",
            False,
        ),
        # bound to multigpu's class by import, not by its spelling
        (
            RECIPE.replace("mg.TrainerSettings", "TS").replace(
                "import multigpu as mg",
                "import multigpu as mg\nfrom multigpu import TrainerSettings as TS",
            ),
            True,
        ),
    ],
)
def test_only_multigpus_own_trainer_settings_are_judged_by_the_launcher(
    tmp_path, monkeypatch, capsys, no_launch, source, refused
):
    """Fresh-eyes finding F4: any `*.TrainerSettings` was checked against ours (a false refusal of the
    user's own class), and the first of several config.load calls decided for all."""
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(source)
    assert cli.main(["run", "train.py", "trainer.epoch=1"]) == (2 if refused else 0)
    assert ("did you mean 'trainer.epochs'" in capsys.readouterr().err) == refused
    assert no_launch == ([] if refused else [("train.py", "trainer.epoch=1")])


def test_a_linked_script_is_read_and_a_blank_resume_path_is_refused(
    tmp_path, monkeypatch, capsys, no_launch
):
    """Fresh-eyes findings F5 and F6: a script reached through a symlink was not read (typos not caught,
    --fresh refused); `--resume ""` was taken and silently did not resume."""
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "real.py").write_text(RECIPE)
    (tmp_path / "train.py").symlink_to(tmp_path / "real.py")
    assert cli.main(["run", "train.py", "trainer.epoch=1"]) == 2
    assert "did you mean 'trainer.epochs'" in capsys.readouterr().err
    assert cli.main(["run", "--fresh", "train.py"]) == 0
    assert no_launch == [("train.py", "trainer.fresh=true")]
    for line in (
        ["--resume", "", "train.py"],
        ["--resume", "  ", "train.py"],
        ["train.py", "trainer.resume_from="],
    ):
        assert cli.main(["run", *line]) == 2
        err = capsys.readouterr().err.strip()
        assert "trainer.resume_from" in err and "non-blank text" in err and "\n" not in err, err
    assert len(no_launch) == 1


@pytest.mark.parametrize(
    "rebinding",
    [
        "TrainerSettings = MySettings",  # rebound by assignment
        "from mine import TrainerSettings",  # rebound by another import
    ],
)
def test_a_rebound_trainer_settings_is_the_scripts_own(
    tmp_path, monkeypatch, capsys, no_launch, rebinding
):
    """Fresh-eyes finding: multigpu's TrainerSettings rebound later in the script was still judged as ours."""
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(
        "from dataclasses import dataclass, field\nimport multigpu as mg\nfrom multigpu import config\n"
        "from multigpu import TrainerSettings\n\n@dataclass\nclass MySettings:\n    my_knob: int = 1\n\n"
        f"{rebinding}\n\n@dataclass\nclass Recipe:\n    trainer: TrainerSettings = field(default_factory=TrainerSettings)\n\n"
        "cfg = config.load(Recipe)\n"
    )
    assert cli.main(["run", "train.py", "trainer.my_knob=3"]) == 0
    assert no_launch == [("train.py", "trainer.my_knob=3")]


def test_a_missing_recipe_file_with_fresh_is_named(tmp_path, monkeypatch, capsys, no_launch):
    from multigpu import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(RECIPE)
    assert cli.main(["run", "--fresh", "train.py", "missing.yaml"]) == 2
    assert "the recipe's settings file 'missing.yaml' does not exist" in capsys.readouterr().err
