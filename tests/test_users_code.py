"""Users' code where it is: their DataLoaders and streams, their own loops with the Trainer's safety,
their Ctrl-C habits, per-rank state, seeds, changed settings on resume, torch.compile, and launcher
output that leaves progress bars alone."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    PY,
    REPO,
    SCRIPTS,
    child_env,
    leftovers_checked,
    multigpu,
    wait_for_files,
    wait_until_gone,
)
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import multigpu as mg
from multigpu.data.adapt import RankShare, StreamLoader, adapt
from multigpu.errors import ConfigError

# A test here (with a module fixture it is the first to use) waits for up to four 2-process launches, each
# capped at 120-240 s by its own subprocess timeout: 600 s for a loaded machine; a hang still ends here.
pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------ DataLoaders (one process)


class Items(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"x": torch.full((2,), float(i)), "id": i}


def _collate(items):
    return {"x": torch.stack([i["x"] for i in items]), "id": [i["id"] for i in items]}


def test_a_dataloader_is_rebuilt_per_rank_with_its_settings():
    user = DataLoader(
        Items(),
        batch_size=3,
        shuffle=True,
        collate_fn=_collate,
        drop_last=True,
        num_workers=1,
        timeout=5,
    )
    mine = adapt(user, dp_rank=1, dp_size=2, batch_size=99, evaluation=False, seed=0)
    assert mine.batch_size == 3 and mine.loader.collate_fn is _collate and mine.loader.timeout == 5
    ids = [i for batch in mine for i in batch["id"]]
    theirs = adapt(user, dp_rank=0, dp_size=2, batch_size=99, evaluation=False, seed=0)
    other = [i for batch in theirs for i in batch["id"]]
    # disjoint halves, drop_last kept
    assert not set(ids) & set(other) and len(ids) == len(other) == 9
    evaluation = adapt(user, dp_rank=1, dp_size=2, batch_size=99, evaluation=True)
    # every sample once, in order
    assert [i for b in evaluation for i in b["id"]] == list(range(1, 20, 2))


@pytest.mark.parametrize(
    "loader, needle",
    [
        (DataLoader(Items(), batch_sampler=[[0, 1], [2, 3]]), "custom batch sampler"),
        (DataLoader(Items(), batch_size=None), "batch_size=None"),
        (
            DataLoader(Items(), batch_size=2, sampler=WeightedRandomSampler([1.0] * 20, 20)),
            "custom sampler",
        ),
    ],
)
def test_what_cannot_be_resharded_is_refused_with_a_hint(loader, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        adapt(loader, dp_rank=0, dp_size=2, batch_size=2, evaluation=False)
    assert info.value.hint


def test_a_plain_batch_sampler_over_a_sequential_sampler_is_kept():
    loader = DataLoader(Items(), batch_sampler=BatchSampler(SequentialSampler(Items()), 4, False))
    mine = adapt(loader, dp_rank=0, dp_size=1, batch_size=1, evaluation=False)
    assert [len(b["id"]) for b in mine] == [4] * 5


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_is_split_by_rank_and_worker_every_item_once(workers):
    seen = []
    for rank in range(2):
        loader = StreamLoader(Stream(23), 3, rank, 2, evaluation=True, num_workers=workers)
        seen += [int(i) for batch in loader for i in batch]
    assert sorted(seen) == list(range(23))


def test_a_resumed_stream_skips_what_each_worker_delivered():
    full = [int(i) for batch in StreamLoader(Stream(40), 2, 0, 1, num_workers=2) for i in batch]
    resumed = StreamLoader(Stream(40), 2, 0, 1, num_workers=2)
    resumed.resume_at(0, 5)
    assert [int(i) for batch in resumed for i in batch] == full[10:]
    share = RankShare(Stream(10), 1, 2, batch_size=1)
    assert list(share) == [1, 3, 5, 7, 9]


def test_fit_takes_a_dataloader_and_a_stream_in_one_process(tmp_path):
    class Fit(mg.Trainer):
        def compute_loss(self, batch):
            return nn.functional.mse_loss(self.model(batch["x"]), batch["x"][:, :1])

    with mg.init(env={}) as run:
        trainer = Fit(
            run,
            nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.01),
            out_dir=str(tmp_path / "a"),
            progress=False,
            plot=False,
        )
        trainer.fit(DataLoader(Items(), batch_size=5, collate_fn=_collate))
        assert trainer.state.global_step == 4  # the DataLoader's batch size, not the Trainer's 32
    with mg.init(env={}) as run:
        stream = [{"x": torch.ones(2), "id": i} for i in range(7)]

        class Gen(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(stream)

        trainer = Fit(
            run,
            nn.Linear(2, 1),
            lambda p: torch.optim.SGD(p, lr=0.01),
            out_dir=str(tmp_path / "b"),
            progress=False,
            batch_size=2,
            collate_fn=_collate,
            accumulate=2,
            plot=False,
        )
        trainer.fit(Gen(), epochs=2)
        # 4 batches, the last alone steps
        assert trainer.state.global_step == 4 and trainer.state.epoch == 2


# ------------------------------------------------------------------ real processes


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def loader_runs(tmp_path_factory) -> Path:
    """loaders.py's modes, each from scratch, one after the other in one 2-process launch (a mode takes well
    under a second, a launch ~5 s): OUT/<mode>/ for each. The Hugging Face modes only where datasets is."""
    root = tmp_path_factory.mktemp("loaders")
    modes = ["dataset", "dataloader", "stream"]
    try:
        import datasets  # noqa: F401

        modes += ["hf-map", "hf-stream"]
    except ImportError:
        pass
    with leftovers_checked() as token:
        # Five short trainings of two processes, with DataLoader workers: 240 s for a busy machine.
        multigpu(
            "run",
            "--nproc",
            "2",
            str(SCRIPTS / "loaders.py"),
            str(root),
            ",".join(modes),
            token,
            check=True,
            timeout=240,
        )
    return root


def test_a_users_dataloader_trains_like_the_dataset_and_resumes_bitwise(
    tmp_path, loader_runs, no_leftovers
):
    script = str(SCRIPTS / "loaders.py")
    proc = multigpu(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        script,
        str(tmp_path),
        "dataloader",
        "--kill-at",
        "7",
        no_leftovers,
        timeout=180,
    )
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stdout + proc.stderr
    dataset, loader = (
        torch.load(loader_runs / n / "final.pt", weights_only=True)
        for n in ("dataset", "dataloader")
    )
    killed = torch.load(tmp_path / "dataloader" / "final.pt", weights_only=True)
    # the same samples in the same order
    assert all(torch.equal(dataset[k], loader[k]) for k in dataset)
    assert all(torch.equal(loader[k], killed[k]) for k in loader)


def test_a_stream_on_two_ranks_with_two_workers_stops_together_and_evaluates_every_sample(
    loader_runs,
):
    ranks = [_json(loader_runs / "stream" / f"seen-rank{r}.json") for r in range(2)]
    trained = ranks[0]["train"] + ranks[1]["train"]
    assert len(trained) == len(set(trained))  # nothing twice
    # 51 and 50 ids in 8 batches each (2 workers x 4)
    assert ranks[0]["steps"] == ranks[1]["steps"] == 8
    assert sorted(trained) == list(range(101))
    evaluated = sorted(ranks[0]["eval"] + ranks[1]["eval"])
    assert evaluated == list(range(101))  # evaluation: every sample exactly once


@pytest.mark.parametrize("mode", ["hf-map", "hf-stream"])
def test_hugging_face_datasets_map_style_and_streaming(loader_runs, mode):
    pytest.importorskip("datasets")
    ranks = [_json(loader_runs / mode / f"seen-rank{r}.json") for r in range(2)]
    assert sorted(ranks[0]["eval"] + ranks[1]["eval"]) == list(range(96))
    trained = ranks[0]["train"] + ranks[1]["train"]
    assert len(trained) == len(set(trained)) and len(trained) >= 88


@pytest.fixture(scope="module")
def own_loop_reference(tmp_path_factory) -> Path:
    """own_loop.py uninterrupted for 60 steps, with the weights after step 24 kept too: the reference of
    both own-loop resume tests (the loop does not depend on --steps). One launch."""
    out = tmp_path_factory.mktemp("own-loop-reference")
    with leftovers_checked() as token:
        multigpu(
            "run",
            "--nproc",
            "2",
            str(SCRIPTS / "own_loop.py"),
            str(out),
            "--steps",
            "60",
            "--snapshot-at",
            "24",
            token,
            check=True,
        )
    return out


def test_an_own_loop_gets_preemption_with_a_bitwise_resume(
    tmp_path, own_loop_reference, no_leftovers
):
    """Every rank holds after step 5 until SIGTERM reaches it (own_loop.py --hold-at), so the signal lands at
    a known step however busy the machine; the agreement is pinned to every step (--check-every 1), so
    where the ranks stop does not depend on a time-based interval."""
    script = str(SCRIPTS / "own_loop.py")
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            "2",
            script,
            str(out),
            "--hold-at",
            "5",
            "--check-every",
            "1",
            "--steps",
            "60",
            no_leftovers,
        ],
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files(out, ["held-rank0", "held-rank1"], timeout=120)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 75, stdout + stderr
    stopped = [int((out / f"stopped-rank{r}.txt").read_text()) for r in range(2)]
    assert stopped[0] == stopped[1] < 60, "every rank stops at the same step"
    assert "stopped by SIGTERM" in stdout
    again = multigpu("run", "--nproc", "2", script, str(out), "--steps", "60", no_leftovers)
    assert again.returncode == 0, again.stderr
    final, expected = (
        torch.load(p / "final.pt", weights_only=True) for p in (out, own_loop_reference)
    )
    assert all(torch.equal(final[k], expected[k]) for k in expected)


def test_an_own_loop_gets_the_hang_report_and_the_desync_guard(tmp_path, no_leftovers):
    """Status 124 comes from the watchdog alone (own_loop.py's collective timeout is 60 s and ends with 1); the
    idle time in the report is measured inside the rank from the hang on, so a slow launch does not count."""
    script = str(SCRIPTS / "own_loop.py")
    hung = multigpu(
        "run",
        "--nproc",
        "2",
        script,
        str(tmp_path / "hang"),
        "--hang-at",
        "3",
        no_leftovers,
        timeout=120,
    )
    assert hung.returncode == 124
    report = (tmp_path / "hang" / "hang" / "report.txt").read_text()
    assert "rank 1: no progress" in report and "own_loop.py" in report
    assert 4 <= int(report.split("rank 1: no progress for ")[1].split(" s")[0]) < 60, report
    notice = [
        line
        for line in hung.stderr.splitlines()
        if line.startswith("[rank0]: multigpu: no training step for")
    ]
    # at 2 s, once
    assert len(notice) == 1 and "rank 1 in user code at own_loop.py:" in notice[0], hung.stderr
    assert "rank 0 in backward (DDP's gradient all-reduce runs here)" in notice[0], notice
    desync = multigpu(
        "run", "--nproc", "2", script, str(tmp_path / "desync"), "--desync", timeout=120
    )
    assert desync.returncode != 0 and "ranks disagree before training" in desync.stderr
    assert "parameter_layout" in desync.stderr and desync.stderr.count("multigpu: error:") == 1


def test_ctrl_c_in_a_script_that_catches_it_ends_every_rank_within_seconds(tmp_path, no_leftovers):
    out = tmp_path / "out"
    out.mkdir()
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            "2",
            str(SCRIPTS / "interrupt.py"),
            str(out),
            no_leftovers,
        ],
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # interrupt.py trains for 100 epochs: it is still training
        wait_for_files(out, ["training"], timeout=120)
        interrupted = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=120)
        took = time.monotonic() - interrupted
    finally:
        launcher.kill()
    # interrupt.py's collective timeout is 300 s: a rank that waited on a collective would take that long.
    # 60 s leaves a busy machine room to stop two workers and a launcher, and still tells the two apart.
    assert took < 60, f"took {took:.0f} s: a rank waited on a collective after the interrupt"
    assert launcher.returncode != 0
    assert "exiting from training early" in stdout
    assert "was interrupted (KeyboardInterrupt" in stderr or "was interrupted (Ctrl-C)" in stderr
    assert not wait_until_gone(no_leftovers, timeout=10)


def test_per_rank_state_survives_sigterm_and_resume_bitwise(tmp_path, no_leftovers):
    """Every rank holds at step 12 until SIGTERM reaches it (stateful_lm.py --hold-at): no sleep races the signal."""
    script = str(SCRIPTS / "stateful_lm.py")
    multigpu(
        "run",
        "--nproc",
        "2",
        script,
        str(tmp_path / "reference"),
        no_leftovers,
        check=True,
        timeout=180,
    )
    out = tmp_path / "out"
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--nproc",
            "2",
            script,
            str(out),
            "--hold-at",
            "12",
            no_leftovers,
        ],
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files(out, ["held-rank0", "held-rank1"], timeout=120)
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    # every worker checkpointed: EXIT_PREEMPTED, "run again to resume"
    assert launcher.returncode == 75
    again = multigpu("run", "--nproc", "2", script, str(out), no_leftovers, timeout=180)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr
    for name in ("final.pt", "hidden-rank0.pt", "hidden-rank1.pt"):
        a, b = (torch.load(p / name, weights_only=True) for p in (out, tmp_path / "reference"))
        pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
        assert all(torch.equal(x, y) for x, y in pairs), name


def test_dropout_differs_per_rank_by_default_and_not_when_asked(tmp_path):
    multigpu(
        "run", "--nproc", "2", str(SCRIPTS / "seeds.py"), str(tmp_path), "default,same", check=True
    )
    for option in ("default", "same"):
        ranks = [_json(tmp_path / option / f"rank{r}.json") for r in range(2)]
        assert ranks[0]["init"] == ranks[1]["init"]  # the model is built the same everywhere
        assert (ranks[0]["mask"] == ranks[1]["mask"]) == (option == "same")


def test_resume_with_a_new_learning_rate_uses_it_and_says_so(tmp_path):
    from conftest import REPO as repo

    recipe, hparams = (
        str(repo / "examples/digits/train.py"),
        str(repo / "examples/digits/hparams.yaml"),
    )
    base = [
        f"trainer.out_dir={tmp_path / 'out'}",
        f"data.folder={tmp_path / 'data'}",
        "optim.schedule=constant",
    ]
    multigpu(
        "run",
        "--nproc",
        "2",
        recipe,
        hparams,
        *base,
        "trainer.epochs=1",
        "optim.lr=0.003",
        check=True,
    )
    again = multigpu(
        "run",
        "--nproc",
        "2",
        recipe,
        hparams,
        *base,
        "trainer.epochs=2",
        "optim.lr=0.001",
        check=True,
    )
    assert "settings changed since the checkpoint" in again.stdout
    assert "optimizer lr 0.003 -> 0.001" in again.stdout and "trainer.epochs 1 -> 2" in again.stdout
    assert again.stdout.count("settings changed") == 1  # printed once, by rank 0
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert rows[-1].split(",")[rows[0].split(",").index("lr")] == "0.001"


def test_compile_wraps_the_model_and_checkpoints_keep_plain_names(tmp_path):
    class Fit(mg.Trainer):
        def compute_loss(self, batch):
            return nn.functional.mse_loss(self.model(batch[0]), batch[1])

    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    with mg.init(env={}) as run:
        trainer = Fit(
            run,
            nn.Linear(3, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            compile={"backend": "eager"},
            out_dir=str(tmp_path),
            progress=False,
            batch_size=4,
            plot=False,
        )
        assert hasattr(trainer.model, "_orig_mod")
        trainer.fit(data)
    (step,) = sorted((tmp_path / "checkpoints").glob("step-*"))[-1:]
    state = torch.load(step / "state.pt", weights_only=True)
    assert set(state["model"]) == {"weight", "bias"}
    with mg.init(env={}) as run:
        again = Fit(
            run,
            nn.Linear(3, 1),
            lambda p: torch.optim.SGD(p, lr=0.1),
            compile={"backend": "eager"},
            out_dir=str(tmp_path),
            progress=False,
            batch_size=4,
            epochs=2,
            plot=False,
        )
        assert again.resume() and again.state.epoch == 1


# ------------------------------------------------------------------ the launcher and the user's terminal

BAR = (
    "import sys, time\nfor i in range(3):\n    sys.stderr.write(f'\\r\\x1b[32mbar {i}\\x1b[0m'); sys.stderr.flush()\n"
    "sys.stderr.write('\\n')\n"
)


def _under_a_terminal(args: list[str], cwd: Path) -> bytes:
    """Run a command with a pseudo-terminal as its stdout/stderr, as a user's shell would; return the bytes."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env=child_env(),
        cwd=str(cwd),
    )
    os.close(follower)
    output = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
    proc.wait(timeout=60)
    os.close(leader)
    return output


def test_progress_bars_pass_through_untouched_and_prefixing_is_an_option(tmp_path):
    script = tmp_path / "bar.py"
    script.write_text(BAR)
    raw = _under_a_terminal([PY, "-m", "multigpu", "run", "--nproc", "2", str(script)], tmp_path)
    # bytes intact, no prefix
    assert raw.count(b"\r\x1b[32mbar 2\x1b[0m") == 2 and b"[rank" not in raw
    prefixed = _under_a_terminal(
        [PY, "-m", "multigpu", "run", "--nproc", "2", "--tee-prefix", "always", str(script)],
        tmp_path,
    )
    assert b"[rank0]: " in prefixed and b"[rank1]: " in prefixed


def test_per_rank_logs_are_removed_on_success_and_kept_and_announced_on_failure(tmp_path):
    # The launcher's temporary folder in a folder of this test's own (TMPDIR): other jobs' launches come and
    # go in /tmp meanwhile, and must not change what this test sees.
    private = {"TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    ok = tmp_path / "ok.py"
    ok.write_text("print('fine')\n")
    proc = multigpu("run", "--nproc", "2", str(ok), env=private, check=True)
    assert list((tmp_path / "tmp").iterdir()) == [] and "logs" not in proc.stderr
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    raise ValueError('boom')\ntime.sleep(30)\n"
    )
    proc = multigpu("run", "--nproc", "2", str(bad), env=private)
    assert proc.returncode == 1 and "logs of every rank are kept in" in proc.stderr
    # rank 0 was stopped by the launcher, it did not fail
    assert "other rank(s) failed" not in proc.stderr
    assert 'File "' + str(bad) in proc.stderr and "runpy" not in proc.stderr  # our frames dropped
    kept = Path(proc.stderr.split("logs of every rank are kept in ")[1].split()[0])
    assert kept.parent == tmp_path / "tmp" and (kept / "rank1.attempt0.stderr").exists()


def test_a_config_error_on_every_rank_is_printed_once(tmp_path):
    """A key of the recipe's own class (model.*) is judged by the script on every rank - once printed. (A
    trainer.* typo never gets that far: the launcher refuses it first, tests/test_torchrun_compat.py.)"""
    recipe = str(REPO / "examples/digits/train.py")
    proc = multigpu("run", "--nproc", "2", recipe, "model.hiden=3")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr  # not once per rank plus the launcher's tail
    assert errors[0].startswith(
        "multigpu: error: the command-line override 'model.hiden=3': unknown key "
        "'model.hiden'. HINT: did you mean 'model.hidden'? (on "
    ), errors


def test_an_own_loop_resumed_at_an_epochs_last_batch_continues_with_the_next_epoch(
    tmp_path, own_loop_reference, no_leftovers
):
    # own_loop.py: 192 samples, batch 8, 2 ranks -> 12 steps per epoch. Stopping at step 12 leaves a
    # checkpoint taken inside the loop over epoch 0's last batch: the resume must start epoch 1.
    script = str(SCRIPTS / "own_loop.py")
    multigpu(
        "run",
        "--nproc",
        "2",
        script,
        str(tmp_path / "out"),
        "--steps",
        "12",
        no_leftovers,
        check=True,
    )
    multigpu(
        "run",
        "--nproc",
        "2",
        script,
        str(tmp_path / "out"),
        "--steps",
        "24",
        no_leftovers,
        check=True,
    )
    final = torch.load(tmp_path / "out" / "final.pt", weights_only=True)
    expected = torch.load(own_loop_reference / "step24.pt", weights_only=True)
    assert all(torch.equal(final[k], expected[k]) for k in expected)
