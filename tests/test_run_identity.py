"""A run's identity (trainer/identity.py): a changed model never resumes a checkpoint it cannot load.

The quickstart's own docstring examples in a row, as a newcomer types them, on one process; then the
placement rules on folders without processes, and manifests that are data from disk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import PY, REPO, child_env
from torch import nn

from multigpu.errors import ConfigError
from multigpu.trainer import identity
from multigpu.trainer.identity import Layout

pytestmark = pytest.mark.timeout(240)


def _train(folder: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(PY), "train.py", "hparams.yaml", "trainer.epochs=1", *overrides],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_quickstart_examples_in_a_row_each_train_their_own_model(tmp_path):
    folder = tmp_path / "quickstart"
    shutil.copytree(REPO / "examples" / "quickstart", folder)
    first = _train(folder)
    assert first.returncode == 0, first.stderr[-2000:]
    # the docstring's own example: a size mismatch before
    wider = _train(folder, "model.hidden=128")
    assert wider.returncode == 0, wider.stderr[-2000:]
    assert (
        "multigpu: a new run in outputs/quickstart-2: outputs/quickstart holds a run of another model or "
        "optimizer (1,348 parameters in 4 tensors; this one: 2,692 parameters in 4 tensors)"
    ) in wider.stdout
    # the same model again: its own folder continues
    again = _train(folder, "model.hidden=128", "trainer.epochs=2")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "continuing the run of this model in outputs/quickstart-2" in again.stdout
    assert "resumed from outputs/quickstart-2/checkpoints/step-00000032" in again.stdout
    assert "trainer.epochs 1 -> 2" in again.stdout
    # the first model: the first folder, no line about folders
    same = _train(folder, "trainer.epochs=2")
    assert (
        "resumed from outputs/quickstart/checkpoints/step-00000032" in same.stdout
        and "new run" not in same.stdout
    )
    tuned = _train(
        folder,
        "trainer.out_dir=outputs/tuned",
        "trainer.epochs=3",
        "trainer.resume_from=outputs/quickstart",
    )
    assert "resumed from outputs/quickstart/checkpoints/step-00000064 (epoch 2" in tuned.stdout, (
        tuned.stdout
    )
    assert "resume_from" not in tuned.stdout  # where a run starts is not a setting that changed
    assert (folder / "outputs" / "tuned" / "checkpoints" / "step-00000096").is_dir()
    assert "Traceback" not in wider.stderr + again.stderr + same.stderr + tuned.stderr
    assert sorted(p.name for p in (folder / "outputs").iterdir()) == [
        "quickstart",
        "quickstart-2",
        "tuned",
    ]
    fresh = subprocess.run(
        [
            str(Path(PY).parent / "multigpu"),
            "run",
            "--fresh",
            "train.py",
            "hparams.yaml",
            "trainer.epochs=1",
        ],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        fresh.returncode == 0
        and "a new run in outputs/quickstart-3: trainer.fresh is set" in fresh.stdout
    ), fresh.stdout + fresh.stderr[-2000:]


A, B = Layout("a" * 32, 4, 100), Layout("b" * 32, 4, 200)


def _looks(held: dict[str, Optional[Layout]]):
    """A fake folder survey: name -> the layout of its newest checkpoint (absent: holds no checkpoint)."""

    def look(folder: Path) -> tuple[bool, Optional[Layout]]:
        return (folder.name in held), held.get(folder.name)

    return look


@pytest.fixture
def base(tmp_path):
    for name in ("out", "out-2", "out-3", "out-10", "out-9", "out-x", "out-02", "outer"):
        (tmp_path / name).mkdir()
    return tmp_path / "out"


def test_siblings_are_numbered_folders_in_numeric_order(base):
    assert [p.name for p in identity.siblings(base)] == ["out-2", "out-3", "out-9", "out-10"]


def test_a_folder_without_a_name_to_number_is_the_absolute_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert identity.named(Path(".")) == tmp_path and identity.named(Path("sub/..")) == tmp_path
    assert identity.named(Path("outputs/x/")) == Path("outputs/x")


def test_a_run_continues_the_folder_of_its_own_layout_and_takes_the_first_free_one_otherwise(base):
    assert identity.place(base, A, look=_looks({"out": A})) == (base, None)
    folder, line = identity.place(base, B, look=_looks({"out": A, "out-2": A, "out-3": B}))
    assert (
        folder.name == "out-3" and line is not None and "continuing the run of this model" in line
    )
    folder, line = identity.place(base, B, look=_looks({"out": A, "out-2": A}))
    assert folder.name == "out-3" and line is not None and "a new run in" in line
    every = {name: A for name in ("out", "out-2", "out-3", "out-9", "out-10")}
    assert identity.place(base, B, look=_looks(every))[0].name == "out-11"
    assert identity.place(base, A, fresh=True, look=_looks(every))[0].name == "out-11"
    # written before layouts: as before
    assert identity.place(base, B, look=_looks({"out": None}))[0] == base
    assert identity.place(base, B, look=_looks({}))[0] == base
    # a free out_dir is this run's, even beside a sibling of the same model (a folder named out-2 by hand)
    assert identity.place(base, B, look=_looks({"out-2": B})) == (base, None)
    # a sibling that names no layout is never continued by a run of another model
    assert identity.place(base, B, look=_looks({"out": A, "out-2": None}))[0].name == "out-3"


def test_a_planted_link_or_file_among_the_siblings_is_never_a_run_folder(base, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out-11").symlink_to(elsewhere)
    (tmp_path / "out-12").write_text("not a folder")
    assert "out-11" not in [p.name for p in identity.siblings(base)]
    every = {name: A for name in ("out", "out-2", "out-3", "out-9", "out-10")}
    assert identity.place(base, B, look=_looks(every))[0].name == "out-13"


def test_under_the_queue_another_model_in_a_runs_folder_is_an_error_not_a_sibling(base):
    with pytest.raises(ConfigError, match="holds a run of another model"):
        identity.place(base, B, in_queue=True, look=_looks({"out": A}))
    assert identity.place(base, A, in_queue=True, look=_looks({"out": A})) == (base, None)


@pytest.mark.parametrize(
    "manifest",
    [
        None,
        [],
        {"layout": "x"},
        {"layout": {"digest": "A" * 32, "tensors": 1, "parameters": 1}},
        {"layout": {"digest": "a" * 32, "tensors": True, "parameters": 1}},
        {"layout": {"digest": "a" * 32, "tensors": 1, "parameters": 10**20}},
        {"layout": {"digest": "a" * 32 + "\x1b[2J", "tensors": 1, "parameters": 1}},
    ],
)
def test_a_manifest_that_names_no_readable_layout_resumes_as_before(manifest):
    assert identity.saved_layout(manifest) is None


def test_a_layout_read_back_is_the_one_written():
    assert identity.saved_layout({"layout": A.meta()}) == A


def test_the_layout_is_the_models_and_the_optimizers_not_the_hyperparameters():
    def layout(
        hidden: int, lr: float = 1e-3, kind=torch.optim.AdamW, groups: bool = False
    ) -> Layout:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, hidden), nn.Linear(hidden, 2))
        params = (
            [
                {"params": model[0].parameters()},
                {"params": model[1].parameters(), "weight_decay": 0},
            ]
            if groups
            else model.parameters()
        )
        return identity.layout_of(model, kind(params, lr=lr), lambda value: [value])

    assert layout(8) == layout(8, lr=0.5)
    assert layout(8).parameters == 4 * 8 + 8 + 8 * 2 + 2 and layout(8).tensors == 4
    assert (
        len(
            {
                layout(8).digest,
                layout(16).digest,
                layout(8, kind=torch.optim.SGD).digest,
                layout(8, groups=True).digest,
            }
        )
        == 4
    )


def test_a_pipeline_stages_layout_is_the_whole_models():
    """Two stages gather each other's parts: the union is the layout of the model in one process."""
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    stages = [
        nn.Sequential(nn.Linear(4, 8), nn.Identity()),
        nn.Sequential(nn.Identity(), nn.Linear(8, 2)),
    ]
    optimizers = [torch.optim.AdamW(s.parameters()) for s in stages]
    sent: list[list[object]] = [[], []]

    def record(stage: int):  # the first pass: what each stage sends
        return lambda value: (
            sent[stage].append(value)
            or [value, value + "other" if isinstance(value, str) else value]
        )

    for stage in (0, 1):
        identity.layout_of(stages[stage], optimizers[stage], record(stage))
    # what all_gather_object returns on both stages
    answers = [[sent[0][i], sent[1][i]] for i in range(2)]
    calls = iter(answers)
    parts = identity.layout_of(stages[0], optimizers[0], lambda value: next(calls))
    assert parts == identity.layout_of(
        whole, torch.optim.AdamW(whole.parameters()), lambda value: [value]
    )


class _Run:
    """What settle needs of a Run, for a world of one."""

    world_size = 1
    control_group = None

    def __init__(self, restart_count: int) -> None:
        from multigpu.distributed.job import Job

        self.world = type("W", (), {"restart_count": restart_count, "launch_id": ""})()
        self.job = Job()
        self.lines: list[str] = []

    def check_writable(self, folder, what):
        return Path(folder)

    def run_on_main(self, fn, *args):
        return fn(*args)

    def print(self, line):
        self.lines.append(line)


def test_a_resume_from_that_does_not_exist_is_one_line_before_anything_is_placed(base):
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="trainer.resume_from .*nowhere does not exist"):
        identity.settle(
            _Run(0),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            str(base),
            fresh=False,
            resume_from=str(base.parent / "nowhere"),
        )


@pytest.mark.parametrize("kind", ["fifo", "file", "empty folder", "link to a step"])
def test_a_resume_from_that_holds_no_checkpoint_is_one_line(tmp_path, kind):
    from multigpu.errors import MultiGPUError

    target = tmp_path / "given"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "file":
        target.write_text("not a checkpoint")
    elif kind == "empty folder":
        target.mkdir()
    else:
        (tmp_path / "step-00000001").mkdir()
        target.symlink_to(tmp_path / "step-00000001")
    # one line with a HINT (the CLI prints it so), never a hang
    with pytest.raises(MultiGPUError) as caught:
        identity.explicit(str(target))
    assert caught.value.hint and "\n" not in str(caught.value)


def test_fresh_is_for_the_first_start_a_restart_continues_where_it_was_placed(base, monkeypatch):
    """A first start with trainer.fresh went to out-3; the job's restart (--max-restarts) continues out-3."""
    assert (
        identity.place(base, A, fresh=True, look=_looks({"out": A, "out-2": A}))[0].name == "out-3"
    )
    folder, line = identity.place(
        base, A, fresh=True, restarted=True, look=_looks({"out": A, "out-2": A, "out-3": A})
    )
    assert (
        folder.name == "out-3" and line is not None and "continuing the run of this model" in line
    )
    # crashed before a checkpoint
    assert identity.place(base, A, fresh=True, restarted=True, look=_looks({}))[0] == base
    # with the launch's id: the folder it made, even before its first checkpoint and below newer ones
    (base.parent / "out-2" / identity.MARKER).write_text("job-7\n")
    every = _looks({"out": A, "out-3": A})
    assert identity.place(base, A, fresh=True, launch="job-7", look=every)[0].name == "out-2"
    # free: a new run there
    assert identity.place(base, A, fresh=True, launch="job-8", look=every)[0].name == "out-2"
    assert (
        identity.place(
            base, A, fresh=True, launch="job-8", look=_looks({"out": A, "out-2": A, "out-3": A})
        )[0].name
        == "out-9"
    )  # the first existing folder without a checkpoint
    placed: list[bool] = []
    monkeypatch.setattr(
        identity,
        "place",
        lambda *args, restarted, **kwargs: placed.append(restarted) or (base, None),
    )
    model = nn.Linear(2, 2)
    for restarts in (0, 2):
        identity.settle(
            _Run(restarts),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            str(base),
            fresh=True,
        )
    assert placed == [False, True]
