"""multigpu queue on CPU slots: inheritance, the slot limit, isolation of failures, resuming an
interrupted queue, stages, and the makespan against the ideal."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import time
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import (
    PY,
    REPO,
    SCRIPTS,
    child_env,
    multigpu,
    multigpu_here,
    processes_with,
    wait_for_files,
)

from multigpu.errors import ConfigError
from multigpu.queue.inheritance import resolve_inheritance
from multigpu.queue.runs import QueueEntry, load_runs
from multigpu.queue.scheduler import Queue
from multigpu.strategies.stages import Stages

# The real queues here run up to five short runs on two slots (up to a few minutes on 2 busy cores).
pytestmark = pytest.mark.timeout(300)
SLEEP = str(SCRIPTS / "sleep_run.py")


def _runs_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "runs.yaml"
    path.write_text(text)
    return path


def _status(folder: Path) -> dict:
    return json.loads((folder / "status.json").read_text())


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


# ------------------------------------------------------------------ runs files (no processes)


def test_inheritance_chains_merge_deeply():
    runs = resolve_inheritance(
        {
            "net": {"script": "t.py", "overrides": {"a": 1, "b": 2}},
            "larger_net < net": {"overrides": {"a": 10}},
            "huge < larger_net": {"gpus": 2},
        }
    )
    assert runs["huge"] == {"script": "t.py", "overrides": {"a": 10, "b": 2}, "gpus": 2}
    assert runs["net"]["overrides"] == {"a": 1, "b": 2}


def test_cycle_unknown_parent_and_duplicates_are_errors_with_lines(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"runs.yaml:2: inheritance cycle a < b < a|runs.yaml:4: inheritance cycle",
    ):
        load_runs(_runs_file(tmp_path, "\na < b:\n  script: x.py\nb < a:\n  script: x.py\n"))
    with pytest.raises(
        ConfigError,
        match=r"runs.yaml:4: 'big' inherits from 'nett', which is not defined.*did you mean 'net'",
    ):
        load_runs(_runs_file(tmp_path, "net:\n  script: x.py\n\nbig < nett:\n  gpus: 2\n"))
    with pytest.raises(ConfigError, match="defined twice"):
        load_runs(
            _runs_file(
                tmp_path, "net:\n  script: x.py\nnet < other:\n  gpus: 1\nother:\n  script: y.py\n"
            )
        )
    with pytest.raises(ConfigError, match=r"run 'net'.*:3: unknown key 'gpu'.*did you mean 'gpus'"):
        load_runs(_runs_file(tmp_path, "net:\n  script: x.py\n  gpu: 2\n"))
    with pytest.raises(ConfigError, match="needs exactly one of script: or module:"):
        load_runs(_runs_file(tmp_path, "net:\n  gpus: 1\n"))


def test_runs_file_of_the_digits_recipe_has_related_configurations():
    specs = {s.name: s for s in load_runs(REPO / "examples" / "digits" / "runs.yaml")}
    assert len(specs) >= 3
    # from larger_net, which got it from net... overridden
    assert specs["deep_net"].overrides["model.hidden"] == 256
    assert specs["deep_net"].overrides["trainer.epochs"] == specs["net"].overrides["trainer.epochs"]


def test_stages_select_a_range_by_name_or_number():
    stages = Stages(["prepare", "train", "evaluate"], start="train")
    assert (
        stages.selected == ["train", "evaluate"]
        and "prepare" not in stages
        and "evaluate" in stages
    )
    # numbers as in ASDF's recipes (from 0): its `recipe.start_stage = 1` is the second stage here too
    assert Stages(["prepare", "train", "evaluate"], start=1, end=1).selected == ["train"]
    assert Stages(["prepare", "train", "evaluate"], start="0", end=0).selected == ["prepare"]
    # ESPnet's --stage
    assert Stages(["prepare", "train", "evaluate"], start=2, end=2, first=1).selected == ["train"]
    with pytest.raises(ConfigError, match="start_stage='trian' is not a stage"):
        Stages(["prepare", "train"], start="trian")
    with pytest.raises(ConfigError, match="comes after end_stage"):
        Stages(["prepare", "train"], start="train", end="prepare")
    with pytest.raises(ConfigError, match=r"numbered 0..1. HINT: stages: 0=prepare, 1=train"):
        Stages(["prepare", "train"], end=2)
    with pytest.raises(ConfigError, match="numbered 1..2"):
        Stages(["prepare", "train"], start=0, first=1)


@pytest.mark.parametrize(
    "value, expected", [(0.5, 0.5), (1.0, 1), (2, 2), (0.25, 0.25), (0.0625, 0.0625)]
)
def test_a_run_takes_whole_gpus_or_a_share_of_one(value, expected):
    spec = QueueEntry("a", script="t.py", gpus=value)
    assert spec.gpus == expected and type(spec.gpus) is type(expected)
    assert spec.processes(True) == max(1, int(expected))


@pytest.mark.parametrize(
    "text, needle",
    [
        ("gpus: 1.5", "gpus 1.5 is neither a whole number nor a share of one GPU"),
        ("gpus: 0.01", "gpus 0.01 is neither"),
        ("gpus: .nan", "gpus must be"),  # refused by the settings door: no number is NaN
        ("gpus: -0.5", "gpus -0.5 is neither"),
        ("gpus: 0", "gpus 0 must be at least 1"),
        ("gpus: half", "gpus must be int"),
        ("gpus: 0.5\n  nproc: 2", "a run on a share of a GPU runs one process"),
    ],
)
def test_bad_shares_are_refused_with_a_hint(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        load_runs(_runs_file(tmp_path, f"a:\n  script: x.py\n  {text}\n"))
    assert needle in str(info.value) and "HINT" in str(info.value)


def test_packing_does_not_change_what_a_run_computes():
    whole, half = QueueEntry("a", script="t.py"), QueueEntry("a", script="t.py", gpus=0.5)
    # rerunning with --runs-per-gpu skips finished runs
    assert whole.fingerprint() == half.fingerprint()
    assert whole.fingerprint() != QueueEntry("a", script="t.py", gpus=2).fingerprint()
    assert (whole.share(4), half.share(4), QueueEntry("b", script="t.py", gpus=2).share(4)) == (
        0.25,
        0.5,
        2,
    )
    assert QueueEntry("c", script="t.py", gpus=0.333).share() * 3 <= 1  # thirds fit on one GPU
    # kept as written, not rounded
    assert QueueEntry("d", script="t.py", gpus=0.97).share() == Fraction(97, 100)


def _placed(tmp_path, runs, slots=("0", "1"), finish=()) -> dict:
    """Where the queue starts each run (no processes): {name: slots} after one pass, after ``finish``."""
    queue = Queue(
        [QueueEntry(n, script="t.py", gpus=g) for n, g in runs], tmp_path, list(slots), on_gpus=True
    )
    queue._start = lambda run, where: (
        setattr(run, "slots", where) or setattr(run, "state", "running")
    )
    queue._launch_ready()
    for run in queue.runs:
        if run.spec.name in finish:
            run.state = "done"
    queue._launch_ready()
    return {r.spec.name: r.slots for r in queue.runs if r.state == "running"}


def test_shares_spread_over_the_gpus_when_nothing_else_waits(tmp_path):
    assert _placed(tmp_path, [("a", 0.5), ("b", 0.5), ("c", 0.25), ("d", 0.5), ("e", 0.5)]) == {
        "a": ["0"],
        "b": ["1"],
        "c": ["0"],
        "d": ["1"],
    }  # e: 0 holds 3/4, 1 holds 1


def test_shares_pack_tightly_and_wait_behind_a_run_of_whole_gpus(tmp_path):
    # A whole-GPU run is queued: shares fill the fullest GPU they fit on, so a GPU stays free for it.
    assert _placed(tmp_path, [("a", 0.5), ("big", 1), ("b", 0.5), ("c", 0.5)]) == {
        "a": ["0"],
        "big": ["1"],
        "b": ["0"],
    }
    # It cannot start yet: later shares wait behind it (never starved); when `a` ends, it gets both GPUs.
    assert _placed(tmp_path, [("a", 0.5), ("big", 2), ("b", 0.25)]) == {"a": ["0"]}
    assert _placed(tmp_path, [("a", 0.5), ("big", 2), ("b", 0.25)], finish=("a",)) == {
        "big": ["0", "1"]
    }


def test_runs_per_gpu_is_capped(tmp_path):
    with pytest.raises(ConfigError, match="--runs-per-gpu 17 is more than 16"):
        Queue([QueueEntry("a", script="t.py")], tmp_path, ["0"], on_gpus=True, runs_per_gpu=17)


# ------------------------------------------------------------------ real queues


def test_runs_packed_on_one_gpu_share_it_with_a_memory_share_each(tmp_path):
    """On this CPU machine the GPU is a name (CUDA_VISIBLE_DEVICES=3 hides nothing: there is no GPU):
    what is checked is the placement, the overlap and the memory share each run is handed (mg.init
    applies it on a real GPU; tests/test_gpu.py checks that)."""
    runs = _runs_file(
        tmp_path,
        "\n".join(
            [
                f"p{i}:\n  script: {SLEEP}\n  args: ['2']\n  out_dir_key: out_dir\n  gpus: 0.5\n"
                for i in range(2)
            ]
            + [f"whole:\n  script: {SLEEP}\n  args: ['0.2']\n  out_dir_key: out_dir\n"]
        ),
    )
    queue = Queue(load_runs(runs), tmp_path / "q", ["3"], on_gpus=True, poll_s=0.05)
    assert queue.execute() == 0
    status = {name: _status(tmp_path / "q" / name) for name in ("p0", "p1", "whole")}
    envs = {name: json.loads((tmp_path / "q" / name / "env.json").read_text()) for name in status}
    assert status["p0"]["slots"] == status["p1"]["slots"] == status["whole"]["slots"] == ["3"]
    assert (status["p0"]["share"], status["whole"]["share"]) == ("1/2", "1")
    assert _max_overlap([(status[n]["started"], status[n]["ended"]) for n in ("p0", "p1")]) == 2
    # whole ran alone
    assert _max_overlap([(status[n]["started"], status[n]["ended"]) for n in status]) == 2
    assert envs["p0"]["memory_fraction"] == envs["p1"]["memory_fraction"] == 0.5
    assert envs["whole"]["memory_fraction"] is None and envs["whole"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert envs["p0"]["run_dir"] == str(tmp_path / "q" / "p0")


def test_runs_per_gpu_packs_cpu_slots_too(tmp_path):
    runs = _runs_file(
        tmp_path,
        "\n".join(
            f"r{i}:\n  script: {SLEEP}\n  args: ['2']\n  out_dir_key: out_dir\n" for i in range(2)
        ),
    )
    out = tmp_path / "q"
    proc = multigpu(
        "queue", str(runs), "--slots", "1", "--runs-per-gpu", "2", "--out", str(out), "--no-live"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    status = [_status(out / f"r{i}") for i in range(2)]
    assert _max_overlap([(s["started"], s["ended"]) for s in status]) == 2
    assert "on slot 0 (1/2)" in proc.stdout
    # CPU: no GPU
    assert json.loads((out / "r0" / "env.json").read_text())["memory_fraction"] is None


def test_five_runs_with_inheritance_on_two_slots(tmp_path):
    runs = _runs_file(
        tmp_path,
        f"""
net:
  script: examples/digits/train.py
  args: [examples/digits/hparams.yaml]
  overrides: {{trainer.epochs: 2, model.hidden: 32, data.folder: {tmp_path / "data"}}}
wide < net:
  overrides: {{model.hidden: 96}}
wider < wide:
  overrides: {{model.hidden: 160}}
deep < wide:
  overrides: {{model.depth: 3}}
fast < net:
  overrides: {{optim.lr: 0.01}}
""",
    )
    out = tmp_path / "q"
    proc = multigpu("queue", str(runs), "--slots", "2", "--out", str(out), "--no-live", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = ["net", "wide", "wider", "deep", "fast"]
    intervals = []
    for name in names:
        folder = out / name
        status = _status(folder)
        assert status["state"] == "done" and status["exit_code"] == 0
        intervals.append((status["started"], status["ended"]))
        resolved = yaml.safe_load((folder / "run.yaml").read_text())
        assert resolved["name"] == name
        assert (folder / "metrics.csv").read_text().count("\n") == 3  # header + 2 epochs
        assert (folder / "config.yaml").exists() and (folder / "log.txt").exists()
    assert (
        yaml.safe_load((out / "deep" / "run.yaml").read_text())["overrides"]["model.hidden"] == 96
    )
    recipe_config = yaml.safe_load((out / "wider" / "config.yaml").read_text())
    assert recipe_config["model"]["hidden"] == 160  # the override reached the recipe
    assert _max_overlap(intervals) == 2  # never more than 2 at once, and the pool was used
    assert "summary" in proc.stdout and "makespan" in proc.stdout


def test_a_run_waits_for_the_runs_it_names_and_reads_their_folders(tmp_path):
    """ASDF's families: `tuned` starts after `net` (after:), given net's folder ({run:net}), on a pool of
    2 slots where it could have started at once; `orphan` waits for a run that fails: never started."""
    runs = _runs_file(
        tmp_path,
        f"""
net:
  script: {SLEEP}
  args: ["0.6"]
  out_dir_key: out_dir
tuned < net:
  args: ["0.1"]
  overrides: {{parent: "{{run:net}}"}}
bad < net:
  args: ["0.1"]
  overrides: {{fail: 1}}
orphan < net:
  args: ["0.1"]
  after: [bad]
""",
    )
    out = tmp_path / "q"
    proc = multigpu("queue", str(runs), "--slots", "2", "--out", str(out), "--no-live")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    net, tuned = _status(out / "net"), _status(out / "tuned")
    assert net["state"] == tuned["state"] == "done" and tuned["started"] >= net["ended"]
    assert json.loads((out / "tuned" / "args.json").read_text())["parent"] == str(out / "net")
    assert not (out / "orphan").exists() and "not started: bad did not finish" in proc.stdout, (
        proc.stdout
    )
    plan = multigpu("queue", str(runs), "--slots", "2", "--out", str(tmp_path / "p"), "--dry-run")
    assert "tuned: would start, 1 slot(s), after net:" in plan.stdout, plan.stdout


@pytest.mark.parametrize(
    "text, needle",
    [
        ("a:\n  script: t.py\n  after: [b]\n", "waits for 'b', which is not a run of this file"),
        ("a:\n  script: t.py\n  after: [a]\n", "waits for itself"),
        (
            "a:\n  script: t.py\n  after: [b]\nb:\n  script: t.py\n  overrides: {x: '{run:a}'}\n",
            "wait for each other",
        ),
        (
            "a:\n  script: t.py\n  after: [s]\ns:\n  script: t.py\n  sweep: {grid: {x: [1, 2]}}\n",
            "a sweep or search",
        ),
        (
            "a:\n  script: t.py\n  overrides: {x: '{run: a}'}\n",
            "holds a {run:...} that is not a run's name",
        ),
        (
            "a:\n  script: t.py\nb:\n  script: t.py\n  overrides: {x: ['{run:a}']}\n",
            "inside a list or mapping",
        ),
        ("a:\n  script: t.py\n  upstream: {b: x}\n", "the queue's own record"),
        # a sweep's values are overrides too: a trial may wait only for a plain run of the file
        (
            "a:\n  script: t.py\n  sweep: {params: {x: ['{run:a-x1}', '{run:nothere}']}}\n",
            "not a run of this file",
        ),
        (
            "n:\n  script: t.py\ns:\n  script: t.py\n  after: [n]\n  sweep: {params: {x: {uniform: [0, 1]}}}\n"
            "  search: {trials: 2, metric: m}\n",
            "searches do not do yet",
        ),
    ],
)
def test_an_order_that_cannot_be_kept_is_refused_with_a_hint(tmp_path, text, needle):
    with pytest.raises(ConfigError, match=needle):
        load_runs(_runs_file(tmp_path, text))


def test_a_changed_parent_changes_its_childrens_fingerprints_and_a_swept_parent_is_refused(
    tmp_path,
):
    """The child's results come from the parent: when the parent's settings change, the child runs again
    (its fingerprint changes with the parent's); under --sweep the parent is many runs: refused."""
    from multigpu.queue.plan import load_plan
    from multigpu.queue.space import parse_cli

    text = "net:\n  script: t.py\n  overrides: {{lr: {lr}}}\nb:\n  script: t.py\n  overrides: {{src: '{{run:net}}'}}\n"
    first = {s.name: s.fingerprint() for s in load_runs(_runs_file(tmp_path, text.format(lr=0.1)))}
    again = {s.name: s.fingerprint() for s in load_runs(_runs_file(tmp_path, text.format(lr=0.1)))}
    changed = {
        s.name: s.fingerprint() for s in load_runs(_runs_file(tmp_path, text.format(lr=0.2)))
    }
    assert first == again and changed["net"] != first["net"] and changed["b"] != first["b"]
    with pytest.raises(ConfigError, match="which is swept here"):
        load_plan(_runs_file(tmp_path, text.format(lr=0.1)), sweep=parse_cli(["lr=0.1,0.2"]))


def test_a_failing_run_is_isolated_and_reported_with_its_log(tmp_path):
    runs = _runs_file(
        tmp_path,
        f"""
ok:
  script: {SLEEP}
  args: ["0.5"]
  out_dir_key: out_dir
bad < ok:
  overrides: {{fail: 1}}
also_ok < ok:
  overrides: {{score: 0.9}}
""",
    )
    out = tmp_path / "q"
    proc = multigpu("queue", str(runs), "--slots", "1", "--out", str(out), "--no-live")
    assert proc.returncode == 1
    assert _status(out / "bad")["state"] == "failed" and _status(out / "bad")["exit_code"] == 4
    assert _status(out / "ok")["state"] == _status(out / "also_ok")["state"] == "done"
    assert "bad failed (exit 4)" in proc.stdout and "this run fails on purpose" in proc.stdout


def test_an_interrupted_queue_resumes_without_redoing_finished_runs(tmp_path):
    """`second` holds at step 2 until the queue's SIGTERM reaches it (faults.py --hold-at): the queue is
    interrupted while `second` trains, however slow the machine."""
    runs = _runs_file(
        tmp_path,
        f"""
first:
  script: {SCRIPTS / "faults.py"}
  args: []
  out_dir_key: null
second < first:
  args: [--hold-at, "2"]
third < first: {{}}
""",
    )
    # faults.py takes its output folder as first argument: give each run its own.
    data = yaml.safe_load(runs.read_text())
    out = tmp_path / "q"
    base = list(data["first"]["args"])
    for key, name in (("first", "first"), ("second < first", "second"), ("third < first", "third")):
        data[key]["args"] = [str(out / name), *(data[key].get("args") or base)]
    runs.write_text(yaml.safe_dump(data))
    # 3 queue runs of 2 processes each, 180 s for a busy machine; a run stuck in its hold ends here.
    queue = subprocess.Popen(
        [PY, "-m", "multigpu", "queue", str(runs), "--slots", "1", "--out", str(out), "--no-live"],
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # `first` is done, `second` is training
        wait_for_files(out / "second", ["held-rank0"], timeout=180)
        queue.send_signal(signal.SIGTERM)
        stdout, _ = queue.communicate(timeout=180)
    finally:
        queue.kill()
    assert queue.returncode == 128 + signal.SIGTERM
    assert _status(out / "first")["state"] == "done"
    assert _status(out / "second")["state"] == "interrupted"
    assert not (out / "third" / "status.json").exists()
    first_ended = _status(out / "first")["ended"]
    again = multigpu(
        "queue", str(runs), "--slots", "1", "--out", str(out), "--no-live", timeout=240
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert _status(out / "first")["ended"] == first_ended  # not redone
    assert _status(out / "second")["state"] == _status(out / "third")["state"] == "done"
    assert "resumed from" in (out / "second" / "log.txt").read_text()
    assert "skipped" in again.stdout


def _a_queue_with_a_held_run(tmp_path: Path, token: str) -> tuple[Path, Path, subprocess.Popen]:
    """A queue (a process of its own) whose one run holds at step 2 until a stop signal reaches it
    (faults.py --hold-at), returned once the run holds, however slow the machine."""
    out = tmp_path / "q"
    runs = _runs_file(
        tmp_path,
        f"""
held:
  script: {SCRIPTS / "faults.py"}
  args: [{out / "held"}, --hold-at, "2", {token}]
  out_dir_key: null
""",
    )
    queue = subprocess.Popen(
        [PY, "-m", "multigpu", "queue", str(runs), "--slots", "1", "--out", str(out), "--no-live"],
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_files(out / "held", ["held-rank0"], timeout=180)
    except BaseException:
        queue.kill()
        raise
    return out, runs, queue


def test_a_queue_killed_by_sigkill_stops_its_run_cleanly_and_the_next_queue_resumes_it(
    tmp_path, no_leftovers
):
    """The queue's death reaches its run's launcher as SIGTERM (the kernel's, ``PR_SET_PDEATHSIG``): the
    workers checkpoint and leave, nothing is left behind, and the next queue resumes it. The run's launcher
    is a new interpreter without the current folder on its path (``python -P -m multigpu run``)."""
    out, runs, queue = _a_queue_with_a_held_run(tmp_path, no_leftovers)
    try:
        queue.kill()
        queue.communicate(timeout=30)
        deadline = time.monotonic() + 120
        while processes_with(no_leftovers) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        queue.kill()
    log = (out / "held" / "log.txt").read_text()
    assert (
        " -P -m multigpu run " in log.splitlines()[1] and "every worker wrote its checkpoint" in log
    ), log
    again = multigpu(
        "queue", str(runs), "--slots", "1", "--out", str(out), "--no-live", timeout=240
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from" in (out / "held" / "log.txt").read_text()


class _Clock:
    """The scheduler's clock, advanced only by its own sleeps: a simulated queue takes no time and no luck."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def strftime(self, *args) -> str:
        return time.strftime(*args)


def test_makespan_of_equal_runs_is_within_ten_percent_of_the_ideal(tmp_path, monkeypatch):
    """Four runs of 3 s on two slots through the real scheduler loop, with a simulated clock and processes
    that end 3 s after they start (the other tests here start real ones): a slot that frees is refilled in
    the pass that notices it, so the makespan is the ideal exactly, not within a margin that holds by luck."""
    from multigpu.queue import scheduler

    clock = _Clock()

    class Process:
        def __init__(self, command, env, **_):
            self.end = clock.now + float(command[command.index(SLEEP) + 1])

        def poll(self):
            return 0 if clock.now >= self.end else None

    monkeypatch.setattr(scheduler, "time", clock)
    monkeypatch.setattr(
        scheduler,
        "subprocess",
        SimpleNamespace(
            Popen=Process, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired
        ),
    )
    runs = _runs_file(
        tmp_path,
        "\n".join(
            f"r{i}:\n  script: {SLEEP}\n  args: ['3']\n  out_dir_key: out_dir\n" for i in range(4)
        ),
    )
    queue = Queue(load_runs(runs), tmp_path / "q", ["0", "1"], on_gpus=False, poll_s=0.125)
    assert queue.execute() == 0
    statuses = [_status(tmp_path / "q" / f"r{i}") for i in range(4)]
    ends = {s["ended"] for s in statuses[:2]}
    # started in the pass its slot freed
    assert [s["started"] in ends for s in statuses[2:]] == [True, True]
    makespan = max(s["ended"] for s in statuses) - min(s["started"] for s in statuses)
    ideal = sum(s["ended"] - s["started"] for s in statuses) / 2
    assert makespan <= 1.10 * ideal
    # 3 s is 24 polls: each end is seen as it happens
    assert makespan == ideal == queue.makespan()[0] == 2 * 3


def test_queue_input_errors_are_one_line_with_a_hint(tmp_path):
    runs = _runs_file(tmp_path, f"a:\n  script: {SLEEP}\n  gpus: 3\n")
    proc = multigpu("queue", str(runs), "--slots", "2", "--out", str(tmp_path / "q"))
    assert (
        proc.returncode == 2
        and "needs 3 slot(s) but the pool has 2" in proc.stderr
        and "HINT" in proc.stderr
    )
    proc = multigpu("queue", str(runs), "--only", "b")
    assert proc.returncode == 2 and "--only names 'b'" in proc.stderr
    proc = multigpu("queue", str(runs), "--gpus", "0")
    assert proc.returncode == 2 and "no GPU is visible" in proc.stderr


def test_digits_stages_evaluate_without_training(tmp_path):
    base = [
        "examples/digits/hparams.yaml",
        f"trainer.out_dir={tmp_path / 'out'}",
        f"data.folder={tmp_path / 'd'}",
        "trainer.epochs=1",
    ]
    missing = multigpu("run", "examples/digits/train.py", *base, "start_stage=train")
    assert missing.returncode == 1 and "run the prepare stage first" in missing.stderr
    trained = multigpu("run", "examples/digits/train.py", *base, "end_stage=train", check=True)
    assert "final validation accuracy" not in trained.stdout
    evaluated = multigpu(
        "run", "examples/digits/train.py", *base, "start_stage=evaluate", check=True
    )
    assert "resumed from" in evaluated.stdout and "final validation accuracy" in evaluated.stdout
    assert "epoch 1/1" not in evaluated.stdout


def test_a_run_whose_settings_changed_starts_afresh_and_keeps_the_old_outputs(tmp_path):
    runs = _runs_file(
        tmp_path,
        f"a:\n  script: {SLEEP}\n  args: ['0.2']\n  out_dir_key: out_dir\n  overrides: {{score: 0.1}}\n",
    )
    out = tmp_path / "q"
    assert (
        multigpu("queue", str(runs), "--slots", "1", "--out", str(out), "--no-live").returncode == 0
    )
    runs.write_text(runs.read_text().replace("score: 0.1", "score: 0.2"))
    again = multigpu("queue", str(runs), "--slots", "1", "--out", str(out), "--no-live")
    assert again.returncode == 0, again.stdout
    assert "0.2" in (out / "a" / "metrics.csv").read_text()
    (old,) = [p for p in out.iterdir() if p.name.startswith("a.old-")]
    assert "0.1" in (old / "metrics.csv").read_text()


@pytest.mark.parametrize(
    "runs_file", ["examples/digits/runs.yaml", "examples/quickstart/runs.yaml"]
)
def test_the_summary_names_the_best_run_of_the_repos_runs_files(tmp_path, runs_file):
    """The repo's own runs files name their metric and mode:, and the summary's best-run line follows them.
    The run with the best accuracy has the worst loss here, so a guessed metric or direction picks another."""
    from types import SimpleNamespace

    from multigpu.queue.display import best_line

    specs = load_runs(REPO / runs_file)
    runs = []
    for i, spec in enumerate(specs):
        folder = tmp_path / spec.name
        folder.mkdir()
        accuracy, loss = 0.5 + 0.1 * i, 0.2 + 0.1 * i
        # the digits recipe writes final.json; the quickstart only metrics.csv
        if "digits" in runs_file:
            (folder / "final.json").write_text(json.dumps({"loss": loss, "accuracy": accuracy}))
        else:
            (folder / "metrics.csv").write_text(
                f"epoch,step,valid_accuracy,valid_loss\n1,10,{accuracy},{loss}\n"
            )
        runs.append(SimpleNamespace(spec=spec, state="done", folder=folder))
    line = best_line(SimpleNamespace(runs=runs, root=tmp_path))
    assert line.startswith(f"best run: {specs[-1].name} ("), line
    assert "highest of" in line


def test_a_runs_files_mode_is_min_or_max(tmp_path):
    path = tmp_path / "runs.yaml"
    path.write_text("a:\n  script: train.py\n  metric: valid_accuracy\n  mode: maximum\n")
    with pytest.raises(ConfigError, match="neither min nor max"):
        load_runs(path)


def test_a_dry_run_on_this_machine_shows_each_run_and_starts_nothing(tmp_path):
    """`multigpu queue runs.yaml --dry-run` without --slurm used to ignore the flag and run the whole queue."""
    runs = _runs_file(
        tmp_path,
        f"""
first:
  script: {SLEEP}
  args: ["0"]
  out_dir_key: out_dir
second < first:
  overrides: {{mode: "off"}}
""",
    )
    out = tmp_path / "q"
    proc = multigpu_here(
        "queue", str(runs), "--slots", "2", "--out", str(out), "--dry-run", check=True
    )
    assert "2 run(s) on 2 slot(s)" in proc.stdout and "nothing started" in proc.stdout
    lines = proc.stdout.splitlines()
    assert any(
        line.startswith("first: would start, 1 slot(s): ") and " -P -m multigpu run " in line
        for line in lines
    )
    second = next(line for line in lines if line.startswith("second: would start"))
    # quoted: YAML would read a bare off as false
    assert "mode='off'" in shlex.split(second.split(": ", 2)[2])
    assert not out.exists()


def test_a_log_file_gets_whole_lines_and_tables_not_80_columns(monkeypatch):
    """Outside a terminal (a Slurm log, `| tee`) rich cut the queue's lines at 80 columns: `train_lo...`,
    run names cut, a metric wrapped onto the next line, grep broken."""
    import io

    from rich.table import Table

    from multigpu.queue.display import LOG_WIDTH, console_for_output

    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    console = console_for_output()
    assert not console.is_terminal and console.width == LOG_WIDTH
    name = "a_run_with_a_long_name_of_a_sweep-lr0.000123-hidden256-depth3-dropout0.25-s2"
    console.print(
        f"[queue] done {name} after 12.3 s (exit 0) valid_loss 0.123456 valid_accuracy 0.987654",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    table = Table("run", "state", "metric")
    table.add_row(name, "done", "valid_loss 0.123456")
    console.print(table)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("valid_accuracy 0.987654") and name in lines[0]
    assert any(name in line and "valid_loss 0.123456" in line for line in lines[1:])


def test_a_parent_outside_the_queue_counts_only_when_its_real_folder_is_done_with_these_settings(
    tmp_path,
):
    from multigpu.queue.run_folder import finished_as

    folder = tmp_path / "net"
    folder.mkdir()
    (folder / "status.json").write_text(json.dumps({"state": "done", "fingerprint": "f1"}))
    (tmp_path / "linked").symlink_to(folder)
    assert (
        finished_as(folder, "f1")
        and not finished_as(folder, "f2")
        and not finished_as(folder, None)
    )
    assert not finished_as(tmp_path / "linked", "f1") and not finished_as(tmp_path / "absent", "f1")
