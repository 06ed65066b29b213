"""Sweeps and searches in the queue: grid and random trials as named runs (stable names, skipped when
done), a TPE search whose pruner stops the planted bad region, a search resumed after its queue
crashed, the Trainer stopping a pruned trial on every rank with its checkpoint kept, and the plot."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import PY, REPO, SCRIPTS, child_env, multigpu

from multigpu.loggers import read_csv
from multigpu.queue.plan import load_plan
from multigpu.queue.space import parse_cli
from multigpu.queue.trials import Trial

SLEEP = str(SCRIPTS / "sleep_run.py")
TRIAL = str(SCRIPTS / "trial_run.py")


def _write(tmp_path: Path, text: str, name: str = "runs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _status(folder: Path) -> dict:
    return json.loads((folder / "status.json").read_text())


def _starts(folder: Path) -> int:
    """How often the queue started this run (one '===' line in its log per start)."""
    return sum(
        1 for line in (folder / "log.txt").read_text().splitlines() if line.startswith("=== ")
    )


# ------------------------------------------------------------------ the space (no processes)


def test_a_grid_is_named_runs_that_inherit_from_their_family(tmp_path):
    runs = _write(
        tmp_path,
        f"""
net:
  script: {SLEEP}
  args: ['0']
  gpus: 1
  overrides: {{score: 0.5, depth: 2}}
grid < net:
  overrides: {{depth: 3}}
  sweep:
    params: {{optim.lr: [1e-3, 0.01], model.hidden: [32, 64]}}
    metric: valid_score
    mode: max
""",
    )
    plan = load_plan(runs)
    names = [r.name for r in plan.runs]
    assert names == [
        "net",
        "grid-lr0.001-hidden32",
        "grid-lr0.001-hidden64",
        "grid-lr0.01-hidden32",
        "grid-lr0.01-hidden64",
    ]
    trial = plan.runs[2]
    assert isinstance(trial, Trial) and trial.family == "grid"
    # inherited + swept
    assert trial.overrides == {"score": 0.5, "depth": 3, "optim.lr": 0.001, "model.hidden": 64}
    assert trial.args == ["0"] and trial.metric == "valid_score"
    assert trial.job_changes(tmp_path / "x") == {"trial_dir": str(tmp_path / "x" / "trial")}
    plain = load_plan(
        _write(
            tmp_path,
            f"t:\n  script: {SLEEP}\n  args: ['0']\n  overrides: {trial.overrides}\n",
            "plain.yaml",
        )
    ).runs[0]
    # a trial computes what the same plain run computes
    assert trial.fingerprint() == plain.fingerprint()
    assert [r.name for r in load_plan(runs, only=["grid-lr0.01-hidden32"]).runs] == [
        "grid-lr0.01-hidden32"
    ]
    assert len(load_plan(runs, only=["grid"]).runs) == 4


def test_random_draws_are_reproducible_in_range_and_stable_when_the_sweep_grows(tmp_path):
    text = f"""
net:
  script: {SLEEP}
r < net:
  sweep:
    params:
      lr: {{loguniform: [1e-4, 1e-1]}}
      hidden: {{choice: [32, 64, 128]}}
      drop: "uniform(0, 0.5)"
      depth: {{int: [1, 4]}}
      act: [relu, gelu]
    samples: SAMPLES
    seed: 7
"""
    plan = load_plan(_write(tmp_path, text.replace("SAMPLES", "5")))
    trials = plan.runs[1:]
    assert len(trials) == 10 and [t.name for t in trials] == [
        t.name for t in load_plan(tmp_path / "runs.yaml").runs[1:]
    ]
    for t in trials:
        v = t.values
        assert 1e-4 <= v["lr"] <= 1e-1 and v["hidden"] in (32, 64, 128) and 0 <= v["drop"] <= 0.5
        assert isinstance(v["depth"], int) and 1 <= v["depth"] <= 4 and v["act"] in ("relu", "gelu")
        assert t.name.startswith(f"r-act{v['act']}-s") or t.name.startswith("r-s")
    assert len({t.name for t in trials}) == 10
    grown = {
        t.name: t.values for t in load_plan(_write(tmp_path, text.replace("SAMPLES", "8"))).runs[1:]
    }
    # more samples: the first five are the same trials
    assert all(grown[t.name] == t.values for t in trials)


def test_the_command_line_sweeps_a_run_of_the_file(tmp_path):
    runs = _write(
        tmp_path,
        f"net:\n  script: {SLEEP}\n  overrides: {{optim.lr: 0.1}}\nother:\n  script: {SLEEP}\n",
    )
    plan = load_plan(runs, only=["net"], sweep=parse_cli(["optim.lr=1e-3,3e-3,1e-2"]))
    assert [(r.name, r.overrides["optim.lr"]) for r in plan.runs] == [
        ("net-lr0.001", 0.001),
        ("net-lr0.003", 0.003),
        ("net-lr0.01", 0.01),
    ]
    drawn = load_plan(
        runs, only=["net"], sweep=parse_cli(["optim.lr=loguniform(1e-4,1e-1)"]), samples=3
    )
    assert [r.name.split("-")[1] for r in drawn.runs] == ["s0", "s1", "s2"]


def test_the_digits_sweeps_file_holds_a_grid_a_random_sweep_and_a_search():
    plan = load_plan(REPO / "examples" / "digits" / "sweeps.yaml")
    assert [f.name for f in plan.families] == ["lr_grid", "lr_random", "lr_search"]
    assert len(
        [r for r in plan.runs if r.name.startswith("lr_grid-")]
    ) == 4 and "lr_grid-lr0.01-hidden32" in {r.name for r in plan.runs}
    (search,) = plan.searches
    assert search.space.search.trials == 4 and search.space.search.pruner == "median"


# ------------------------------------------------------------------ grid on the pool


def test_a_grid_of_4_on_2_slots_runs_every_trial_ranks_them_and_a_rerun_skips(
    tmp_path, no_leftovers
):
    runs = _write(
        tmp_path,
        f"""
base:
  script: {SLEEP}
  args: ['0.5']
  out_dir_key: out_dir
grid < base:
  sweep:
    params: {{score: [0.2, 0.9], tag: [a, b]}}
    metric: valid_score
    mode: max
""",
    )
    out = tmp_path / no_leftovers
    first = multigpu(
        "queue",
        str(runs),
        "--only",
        "grid",
        "--slots",
        "2",
        "--out",
        str(out),
        "--no-live",
        timeout=240,
    )
    assert first.returncode == 0, first.stdout + first.stderr
    names = ["grid-score0.2-taga", "grid-score0.2-tagb", "grid-score0.9-taga", "grid-score0.9-tagb"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == names
    ended = {}
    for name in names:
        status = _status(out / name)
        assert status["state"] == "done"
        ended[name] = status["ended"]
        settings = json.loads((out / name / "trial" / "trial.json").read_text())
        assert settings == {"metric": "valid_score", "wait_s": 0.0}
    assert (
        "best of grid: score=0.9 tag=a (grid-score0.9-taga, valid_score 0.9, highest of 4 finished)"
        in first.stdout
    )
    record = json.loads((out / ".sweeps" / "grid.json").read_text())
    assert [t["run"] for t in record["trials"]][:2] == ["grid-score0.9-taga", "grid-score0.9-tagb"]
    assert record["mode"] == "max" and record["params"]["tag"] == {
        "kind": "grid",
        "values": ["a", "b"],
    }
    again = multigpu(
        "queue", str(runs), "--only", "grid", "--slots", "2", "--out", str(out), "--no-live"
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("skipped grid-") == 4 and "start " not in again.stdout
    assert {name: _status(out / name)["ended"] for name in names} == ended  # not run again
    one = multigpu(
        "queue",
        str(runs),
        "--only",
        "grid-score0.2-tagb",
        "--slots",
        "2",
        "--out",
        str(out),
        "--no-live",
    )
    assert one.returncode == 0 and "skipped grid-score0.2-tagb" in one.stdout, (
        one.stdout + one.stderr
    )
    # the others still ranked
    assert len(json.loads((out / ".sweeps" / "grid.json").read_text())["trials"]) == 4
    plotted = multigpu("plot", str(out), timeout=120)
    assert plotted.returncode == 0, plotted.stdout + plotted.stderr
    assert (out / "sweep-grid.png").stat().st_size > 1000 and "sweep grid" in plotted.stdout


# ------------------------------------------------------------------ a search with a pruner


def _median_rule(trials: list[dict]) -> set[str]:
    """Which trials the median pruner must stop, replayed from the trials in the order they ran (one at a
    time): a bad trial (10 + 1/step) is pruned at its first report when the finished trials' median at
    that step is below its value - when at least half of them are good (1/step). Good trials never are
    (their value equals the good median, and pruning needs a worse one)."""
    good = bad = 0
    expected = set()
    for trial in trials:
        is_bad = trial["values"]["x"] > 0.6
        if is_bad and good + bad >= 1 and good >= bad:
            expected.add(trial["run"])
            continue
        good, bad = good + (not is_bad), bad + is_bad
    return expected


def test_a_tpe_search_prunes_the_planted_bad_region(tmp_path, no_leftovers):
    pytest.importorskip("optuna")
    runs = _write(
        tmp_path,
        f"""
base:
  script: {TRIAL}
  out_dir_key: out_dir
  overrides: {{steps: 4}}
tpe < base:
  sweep:
    params: {{x: {{uniform: [0.0, 1.0]}}}}
  search: {{sampler: tpe, trials: 6, startup_trials: 4, metric: valid_loss, mode: min, pruner: median, min_trials: 1}}
""",
    )
    out = tmp_path / no_leftovers
    # One trial at a time: which trials finished before another reports is then the same on every run.
    proc = multigpu(
        "queue",
        str(runs),
        "--only",
        "tpe",
        "--slots",
        "2",
        "--max-parallel",
        "1",
        "--out",
        str(out),
        "--no-live",
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((out / ".sweeps" / "tpe.json").read_text())
    trials = sorted(record["trials"], key=lambda t: int(t["run"].split("-t")[1].split("-")[0]))
    assert [t["run"].split("-")[1] for t in trials] == [f"t{i}" for i in range(6)]
    pruned = {t["run"] for t in trials if t["state"] == "pruned"}
    assert pruned == _median_rule(trials) and pruned, (
        pruned,
        [(t["run"], t["state"]) for t in trials],
    )
    for trial in trials:
        done = json.loads((out / trial["run"] / "done.json").read_text())
        bad = trial["values"]["x"] > 0.6
        # run.report answered True in the trial itself
        assert done["pruned"] == (trial["run"] in pruned)
        assert done["last_step"] == (1 if trial["run"] in pruned else 4)
        assert trial["state"] in ("done", "pruned") and (trial["state"] == "done" or bad)
    assert f"{len(pruned)} pruned" in proc.stdout and "best of tpe: x=" in proc.stdout
    assert (out / ".sweeps" / "tpe.db").is_file()


def test_asha_prunes_trials_behind_at_their_first_rung(tmp_path):
    """The queue's half of pruning without processes: reports written as a trial's rank 0 would, read
    by the search's poll, answered in verdict.json, told to the study when the trial ends."""
    optuna = pytest.importorskip("optuna")
    from types import SimpleNamespace

    from multigpu.queue.search import Search
    from multigpu.queue.trials import read_verdict

    runs = _write(
        tmp_path,
        f"base:\n  script: {SLEEP}\n  out_dir_key: out_dir\na < base:\n"
        "  sweep: {params: {x: {uniform: [0, 1]}}}\n"
        "  search: {sampler: random, trials: 6, pruner: asha, min_steps: 1}\n",
    )
    (family,) = load_plan(runs).searches
    search = Search(family.entry, family.space, tmp_path / "out")
    assert search.start() == []
    stopped = {}
    for index in range(6):
        trial = search.ask()
        folder = tmp_path / "out" / trial.name
        trial.prepare(folder)
        run = SimpleNamespace(spec=trial, folder=folder, state="running", note="")
        # a good trial first: ASHA promotes what is in the top quarter of a rung
        bad = index in (1, 2, 4, 5)
        rows = "step,value\n"
        for step in range(1, 9):
            rows += f"{step},{(10.0 if bad else 0.0) + 1.0 / step}\n"
            (folder / "trial" / "reports.csv").write_text(rows)
            search.poll([run])
            if read_verdict(folder) == (step, True):
                break
        stopped[trial.name] = step
        run.state = "done"
        search.finished(run)
    search.close()
    states = [t.state.name for t in search.study.get_trials()]
    assert states == ["COMPLETE", "PRUNED", "PRUNED", "COMPLETE", "PRUNED", "PRUNED"]
    assert [stopped[t.user_attrs["run"]] for t in search.study.get_trials()] == [8, 1, 1, 8, 1, 1]
    assert search.study.best_value == pytest.approx(1 / 8) and optuna.__version__


# ------------------------------------------------------------------ a crash in the middle of a study


def test_a_trial_asked_but_never_named_before_a_crash_is_asked_again(tmp_path):
    """The queue asks the study for a trial, then names it (two writes to the study): a queue killed in
    between left a trial no run holds, and the next queue counted it, so the search ran one trial short
    (seen once in a clean-clone run). Only named trials count."""
    pytest.importorskip("optuna")
    from multigpu.queue.search import Search

    runs = _write(
        tmp_path,
        f"base:\n  script: {SLEEP}\n  out_dir_key: out_dir\na < base:\n"
        "  sweep: {params: {x: {uniform: [0, 1]}}}\n  search: {sampler: random, trials: 3}\n",
    )
    (family,) = load_plan(runs).searches
    first = Search(family.entry, family.space, tmp_path / "out")
    assert first.start() == []
    named = first.ask()
    first.study.ask(first._distributions)  # the crash: asked, and killed before set_user_attr
    first.close()
    again = Search(family.entry, family.space, tmp_path / "out")
    earlier = again.start()
    assert [t.name for t in earlier] == [named.name]
    asked = []
    while again.wants_more():
        asked.append(again.ask().name)
    again.close()
    # 3 named trials in all, as the file says
    assert len(asked) == 2 and named.name not in asked, asked


def test_a_search_resumes_after_its_queue_crashed_without_repeating_finished_trials(
    tmp_path, no_leftovers
):
    pytest.importorskip("optuna")
    runs = _write(
        tmp_path,
        f"""
base:
  script: {SLEEP}
  args: ['1.5']
  out_dir_key: out_dir
rs < base:
  sweep:
    params: {{score: {{uniform: [0.0, 1.0]}}}}
  search: {{sampler: random, trials: 4, metric: valid_score, mode: max}}
""",
    )
    out = tmp_path / no_leftovers
    argv = [
        PY,
        "-m",
        "multigpu",
        "queue",
        str(runs),
        "--only",
        "rs",
        "--slots",
        "2",
        "--out",
        str(out),
        "--no-live",
    ]
    queue = subprocess.Popen(
        argv,
        env=child_env(),
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:  # one trial finished and a third one asked: crash now
            folders = [p for p in out.glob("rs-t*") if (p / "status.json").exists()]
            if len(folders) >= 3 and any(_status(p)["state"] == "done" for p in folders):
                break
            time.sleep(0.05)
        # no cleanup at all: the study and the folders stay as they were
        queue.send_signal(signal.SIGKILL)
        queue.communicate(timeout=60)
    finally:
        queue.kill()
    # A trial's folder, log line and process come before its status.json (scheduler._start_process): a
    # SIGKILL between them leaves a folder without one - a trial cut off like a running one (seen once in 20)
    before = {p.name: _status(p) if (p / "status.json").exists() else {} for p in out.glob("rs-t*")}
    starts = {p.name: _starts(p) if (p / "log.txt").exists() else 0 for p in out.glob("rs-t*")}
    finished = {name for name, status in before.items() if status.get("state") == "done"}
    assert finished and len(before) >= 3
    again = multigpu(
        "queue",
        str(runs),
        "--only",
        "rs",
        "--slots",
        "2",
        "--out",
        str(out),
        "--no-live",
        timeout=240,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    after = {p.name: _status(p) for p in out.glob("rs-t*")}
    # exactly the study's 4 trials, names kept
    assert sorted(after) == sorted(set(after)) and len(after) == 4
    assert set(before) <= set(after)
    for name in finished:  # finished before the crash: told, never run again
        assert (
            after[name]["ended"] == before[name]["ended"]
            and _starts(out / name) == starts[name] == 1
        )
    # cut off by the crash: resumed in their folders, started once more
    for name in set(before) - finished:
        assert after[name]["state"] == "done" and _starts(out / name) == starts[name] + 1
    assert all(status["state"] == "done" for status in after.values())
    record = json.loads((out / ".sweeps" / "rs.json").read_text())
    assert len(record["trials"]) == 4 and all(t["state"] == "done" for t in record["trials"])
    best = max(record["trials"], key=lambda t: t["value"])
    # ranked by its metric, highest first (mode max)
    assert record["trials"][0]["run"] == best["run"]


# ------------------------------------------------------------------ the Trainer's side


TRAINER_SCRIPT = """
import json, os, sys, torch
import multigpu as mg
from torch import nn
from torch.utils.data import TensorDataset

class T(mg.Trainer):
    def compute_loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

run = mg.init(seed=0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g))
trainer = T(run, nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.01), out_dir=sys.argv[1], batch_size=4,
            epochs=3, eval_every_steps=2, progress=False, plot=False, hang_timeout_s=None)
trainer.fit(data, data)
with open(os.path.join(sys.argv[1], f"rank{run.rank}.json"), "w") as handle:
    json.dump({"step": trainer.state.global_step}, handle)
"""


def _answer_reports(channel: Path, prune_at_report: int, stop: threading.Event) -> None:
    """The queue's half, by hand: answer each report; prune at the ``prune_at_report``-th one."""
    while not stop.is_set():
        rows = read_csv(channel / "reports.csv")
        if rows:
            (channel / "verdict.tmp").write_text(
                json.dumps({"step": int(rows[-1]["step"]), "prune": len(rows) >= prune_at_report})
            )
            (channel / "verdict.tmp").replace(channel / "verdict.json")
        time.sleep(0.02)


def test_the_trainer_stops_a_pruned_trial_on_every_rank_and_keeps_its_checkpoint(
    tmp_path, no_leftovers
):
    out, channel = tmp_path / no_leftovers, tmp_path / "trial"
    channel.mkdir()
    (channel / "trial.json").write_text(json.dumps({"metric": "valid_loss", "wait_s": 60}))
    script = tmp_path / "fit.py"
    script.write_text(TRAINER_SCRIPT)
    stop = threading.Event()
    answering = threading.Thread(target=_answer_reports, args=(channel, 2, stop), daemon=True)
    answering.start()
    try:
        proc = multigpu(
            "run",
            "--nproc",
            "2",
            "--cpu",
            str(script),
            str(out),
            timeout=240,
            env={"MULTIGPU_JOB": json.dumps({"trial_dir": str(channel)})},
        )
    finally:
        stop.set()
        answering.join()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = read_csv(channel / "reports.csv")
    # 4 steps per epoch on 2 ranks: evaluations at 2 and 4
    assert [int(r["step"]) for r in reports] == [2, 4]
    assert all(math.isfinite(float(r["value"])) for r in reports)
    assert proc.stdout.count("pruned by the queue's search at step 4 (valid_loss ") == 1
    # both ranks
    assert [json.loads((out / f"rank{r}.json").read_text())["step"] for r in (0, 1)] == [4, 4]
    assert (out / "checkpoints" / "step-00000004").is_dir()
    assert [int(r["step"]) for r in read_csv(out / "metrics.csv")][-1] == 4


def test_report_outside_a_queue_trial_is_free(tmp_path):
    import multigpu as mg

    with mg.init(env={}) as run:
        assert run.report(0.5, 1) is False and run.report({"valid_loss": 1.0}, 2) is False
    assert not any(tmp_path.iterdir())
