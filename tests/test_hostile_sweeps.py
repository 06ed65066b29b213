"""Hostile sweeps, searches and trial channels: every bad input is refused before anything is written
or started, as one ``multigpu: error: ... HINT: ...`` line (cut when it echoes a huge value) - in the
runs file (``sweep:``, ``search:``), on the command line (``--sweep``, ``--samples``, ``--only``), in
the files a trial and its queue exchange, and in a sweep record handed to ``multigpu plot``."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import PY, SCRIPTS, child_env

from multigpu.errors import MAX_LINE, ConfigError
from multigpu.guards.trial import TrialChannel
from multigpu.queue.plan import load_plan
from multigpu.queue.space import parse_cli
from multigpu.queue.trials import read_reports, read_verdict

pytestmark = pytest.mark.timeout(120)
SLEEP = str(SCRIPTS / "sleep_run.py")
BASE = f"base:\n  script: {SLEEP}\n  args: ['0']\n  out_dir_key: out_dir\n"


def family(sweep: str, search: str = "", extra: str = "") -> str:
    return (
        BASE
        + extra
        + f"f < base:\n  sweep: {sweep}\n"
        + (f"  search: {search}\n" if search else "")
    )


# 4**10 = 1,048,576 trials
MILLION = "{" + ", ".join(f"p{i}: [1, 2, 3, 4]" for i in range(10)) + "}"
FILE_CASES = [
    ("empty-grid", family("{params: {lr: []}}"), "the list of values is empty"),
    ("empty-choice", family("{params: {lr: {choice: []}}}"), "the list of values is empty"),
    (
        "empty-range",
        family("{params: {lr: {uniform: [1, 1]}}}"),
        "is empty (low must be below high)",
    ),
    (
        "inverted-int-range",
        family("{params: {depth: {int: [5, 2]}}}"),
        "is empty (low must be below high)",
    ),
    ("loguniform-from-zero", family("{params: {lr: {loguniform: [0, 1]}}}"), "needs a low above 0"),
    ("nan-bound", family("{params: {lr: {uniform: [.nan, 1]}}}"), "is not a finite number"),
    ("nan-text-bound", family("{params: {lr: {uniform: ['nan', 1]}}}"), "is not a finite number"),
    ("inf-bound", family("{params: {lr: {loguniform: [1e-4, .inf]}}}"), "is not a finite number"),
    (
        "huge-number-bound",
        family("{params: {lr: {uniform: [0, '1e999']}}}"),
        "is not a finite number",
    ),
    ("float-int-bounds", family("{params: {depth: {int: [1.5, 3]}}}"), "are not whole numbers"),
    ("text-bounds", family("{params: {lr: {uniform: [a, b]}}}"), "are not numbers"),
    ("one-bound", family("{params: {lr: {uniform: [1]}}}"), "takes [low, high]"),
    (
        "unknown-distribution",
        family("{params: {lr: {normal: [0, 1]}}}"),
        "unknown distribution 'normal'",
    ),
    (
        "misspelt-distribution",
        family("{params: {lr: {loguniforn: [1e-4, 1]}}}"),
        "did you mean 'loguniform'",
    ),
    (
        "two-distributions",
        family("{params: {lr: {uniform: [0, 1], int: [1, 2]}}}"),
        "nor one distribution",
    ),
    ("unknown-call", family("{params: {lr: 'beta(1, 2)'}}"), "unknown distribution 'beta'"),
    ("bad-call", family("{params: {lr: 'uniform(0, 1'}}"), "cannot read"),
    ("million-grid", family(f"{{params: {MILLION}}}"), "more than 10,000 trials"),
    (
        "million-samples",
        family("{params: {lr: {uniform: [0, 1]}}, samples: 1000000}"),
        "samples=1000000 is invalid",
    ),
    ("samples-without-draws", family("{params: {lr: [1, 2]}, samples: 3}"), "nothing is drawn"),
    ("names-collide", family("{params: {tag: ['a/b', 'a_b']}}"), "would be named 'f-taga_b'"),
    ("same-value-twice", family("{params: {lr: [1e-3, 0.001]}}"), "is given twice"),
    (
        "trial-named-like-a-run",
        family("{params: {lr: [0.1, 0.2]}}", extra=f"f-lr0.1:\n  script: {SLEEP}\n"),
        "would be named 'f-lr0.1', like run 'f-lr0.1'",
    ),
    (
        "trial-named-like-a-run-in-another-case",
        family("{params: {lr: [0.1]}}", extra=f"F-LR0.1:\n  script: {SLEEP}\n"),
        "like run 'F-LR0.1'",
    ),
    (
        "huge-value",
        family("{params: {tag: [" + "x" * 1_000_000 + "]}}"),
        "a value of 1,000,000 characters",
    ),
    ("huge-key", family("{params: {" + "k" * 900 + ": [1, 2]}}"), "longer than 200 characters"),
    ("control-characters", family('{params: {tag: ["a\\e[31m"]}}'), "contains control characters"),
    (
        "nested-value",
        family("{params: {lr: [[1, 2]]}}"),
        "is not a number, true/false, null or text",
    ),
    ("sweeps-the-out-dir", family("{params: {out_dir: [a, b]}}"), "the queue sets out_dir"),
    ("sweep-not-a-mapping", family("5"), "sweep must be a group of settings"),
    (
        "params-not-a-mapping",
        family("{params: [1, 2]}"),
        "must map overrides to values or distributions",
    ),
    ("no-params", family("{samples: 2}"), "sweep has no params"),
    ("misspelt-params", family("{param: {lr: [1, 2]}}"), "did you mean 'params'"),
    ("bad-mode", family("{params: {lr: [1, 2]}, mode: up}"), "mode='up' is invalid"),
    ("huge-metric", family("{params: {lr: [1, 2]}, metric: " + "m" * 5000 + "}"), "metric="),
    (
        "too-many-params",
        family("{params: {" + ", ".join(f"p{i}: [1]" for i in range(65)) + "}}"),
        "at most 64",
    ),
    (
        "too-many-values",
        family("{params: {lr: [" + ", ".join(map(str, range(1001))) + "]}}"),
        "at most 1,000 per",
    ),
    (
        "search-without-sweep",
        BASE + "f < base:\n  search: {trials: 4}\n",
        "search: without a sweep:",
    ),
    (
        "search-without-trials",
        family("{params: {lr: [1, 2]}}", "{sampler: tpe}"),
        "search has no trials",
    ),
    (
        "unknown-sampler",
        family("{params: {lr: [1, 2]}}", "{sampler: cmaes, trials: 4}"),
        "sampler='cmaes' is invalid",
    ),
    (
        "unknown-pruner",
        family("{params: {lr: [1, 2]}}", "{pruner: hyperband, trials: 4}"),
        "pruner='hyperband'",
    ),
    (
        "million-search",
        family("{params: {lr: [1, 2]}}", "{trials: 1000000}"),
        "trials=1000000 is invalid",
    ),
    (
        "boolean-trials",
        family("{params: {lr: [1, 2]}}", "{trials: true}"),
        "trials=True is invalid",
    ),
    (
        "misspelt-search-key",
        family("{params: {lr: [1, 2]}}", "{trials: 4, prunner: asha}"),
        "did you mean 'pruner'",
    ),
    (
        "samples-and-search",
        family("{params: {lr: {uniform: [0, 1]}}, samples: 2}", "{trials: 4}"),
        "both say how many trials",
    ),
    (
        "metrics-disagree",
        family("{params: {lr: [1, 2]}, metric: a}", "{trials: 4, metric: b}"),
        "differ",
    ),
    (
        "search-not-a-mapping",
        family("{params: {lr: [1, 2]}}", "[tpe]"),
        "search must be a group of settings",
    ),
    (
        "run-named-like-a-search-trial",
        family("{params: {lr: [1, 2]}}", "{trials: 4}", extra=f"f-t3-lr1:\n  script: {SLEEP}\n"),
        "named like a trial of the search",
    ),
    (
        "too-many-trials-together",
        BASE
        + "".join(
            f"f{i} < base:\n  sweep: {{params: {{lr: {{uniform: [0, 1]}}}}, samples: 4000}}\n"
            for i in range(3)
        ),
        "12,000 trials together",
    ),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_a_hostile_runs_file_is_refused_in_one_line(tmp_path, case):
    _, text, expect = case
    runs = tmp_path / "runs.yaml"
    runs.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_plan(runs)
    line = info.value.one_line()
    assert expect in line and "HINT:" in line and len(line) <= MAX_LINE and "\n" not in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.yaml"]  # nothing written


CLI_CASES = [
    ("no-equals", ["--sweep", "lr"], "is not KEY=VALUES"),
    ("no-values", ["--sweep", "lr="], "the list of values is empty"),
    ("unknown-distribution", ["--sweep", "lr=normal(0,1)"], "unknown distribution 'normal'"),
    ("one-bound", ["--sweep", "lr=loguniform(1e-4)"], "takes [low, high]"),
    ("swept-twice", ["--sweep", "lr=1,2", "--sweep", "lr=3"], "sweeps lr twice"),
    ("nan", ["--sweep", "lr=uniform(nan,1)"], "is not a finite number"),
    ("zero-samples", ["--sweep", "lr=uniform(0,1)", "--samples", "0"], "samples=0 is invalid"),
    ("samples-of-nothing", ["--samples", "3"], "sweeps nothing"),
    ("the-out-dir", ["--sweep", "out_dir=a,b"], "the queue sets it"),
    (
        "million-grid",
        [a for i in range(10) for a in ("--sweep", f"p{i}=1,2,3,4")],
        "more than 10,000 trials",
    ),
    ("unknown-only", ["--only", "nothing"], "--only names 'nothing'"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_a_hostile_command_line_is_refused_in_one_line(tmp_path, case):
    _, argv, expect = case
    (tmp_path / "runs.yaml").write_text(BASE)
    started = time.monotonic()
    proc = subprocess.run(
        [
            PY,
            "-m",
            "multigpu",
            "queue",
            "runs.yaml",
            "--out",
            "out",
            "--slots",
            "1",
            "--no-live",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=child_env(),
    )
    assert proc.returncode == 2 and time.monotonic() - started < 60, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert len(errors) == 1 and "HINT:" in errors[0] and expect in errors[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_parse_cli_keeps_numbers_text_and_switches():
    (lr,), (act,) = parse_cli(["optim.lr=1e-3,0.01"]), parse_cli(["act=relu,gelu,null,true"])
    assert lr.values == (0.001, 0.01) and act.values == ("relu", "gelu", None, True)


# ------------------------------------------------------------------ the trial channel


def _channel(folder: Path, is_main: bool = True) -> TrialChannel:
    return TrialChannel(str(folder), is_main, agree=lambda flag: flag, say=lambda line: None)


@pytest.mark.parametrize(
    "settings, expect",
    [
        (None, "cannot read"),
        ("{not json", "cannot read"),
        ('{"metric": "", "wait_s": 0}', "are malformed"),
        ('{"metric": "valid_loss", "wait_s": -1}', "are malformed"),
        ('{"metric": "valid_loss", "wait_s": 1e9}', "malformed"),
        ('{"metric": "valid_loss", "wait_s": true}', "are malformed"),
        ('["valid_loss", 0]', "are malformed"),
    ],
)
def test_malformed_trial_settings_are_one_line(tmp_path, settings, expect):
    if settings is not None:
        (tmp_path / "trial.json").write_text(settings)
    with pytest.raises(ConfigError, match=expect) as info:
        _channel(tmp_path).report(0.5, 1)
    assert "MULTIGPU_JOB" in info.value.hint
    assert not (tmp_path / "reports.csv").exists()


@pytest.mark.parametrize(
    "value, step, expect",
    [
        ("0.5", 1, "not a number"),
        (True, 1, "not a number"),
        (None, 1, "not a number"),
        ([1.0], 1, "not a number"),
        (
            {"valid_accuracy": 0.9},
            1,
            "metric 'valid_loss' is not among the metrics reported (valid_accuracy)",
        ),
        (0.5, -1, "outside 0..2**62"),
        (0.5, 2**70, "outside"),
        (0.5, 1.5, "not a whole number"),
        (0.5, True, "not a whole number"),
        (0.5, "3", "not a whole number"),
    ],
)
def test_bad_reports_are_one_line(tmp_path, value, step, expect):
    (tmp_path / "trial.json").write_text('{"metric": "valid_loss", "wait_s": 0}')
    with pytest.raises(ConfigError) as info:
        _channel(tmp_path).report(value, step)
    assert expect in info.value.one_line() and "HINT:" in info.value.one_line()
    assert not (tmp_path / "reports.csv").exists()


def test_a_report_of_inf_counts_as_nan_and_the_queue_is_not_waited_for_forever(tmp_path):
    (tmp_path / "trial.json").write_text('{"metric": "valid_loss", "wait_s": 0.2}')
    said = []
    channel = TrialChannel(str(tmp_path), True, agree=lambda flag: flag, say=said.append)
    # nobody answers: it waits 0.2 s once, then goes on
    assert channel.report(float("inf"), 1) is False
    assert channel.report({"valid_loss": 0.25}, 2) is False and channel.wait_s == 0
    assert (tmp_path / "reports.csv").read_text() == "step,value\n1,nan\n2,0.25\n" and len(
        said
    ) == 1


def test_the_queue_reads_hostile_channel_files_as_nothing(tmp_path):
    trial = tmp_path / "run" / "trial"
    trial.mkdir(parents=True)
    (trial / "reports.csv").write_text(
        "step,value\n1,0.5\nx,1\n2,nan\n2,0.1\n-3,1\n1,0.2\n4,inf\n5,1e400\n6,0.3\n7,"
    )
    assert read_reports(tmp_path / "run")[:3] == [
        (1, 0.5),
        (2, pytest.approx(float("nan"), nan_ok=True)),
        (4, pytest.approx(float("nan"), nan_ok=True)),
    ]
    # the torn last row is left out
    assert [s for s, _ in read_reports(tmp_path / "run")] == [1, 2, 4, 5, 6]
    for text in (
        "",
        "{",
        '{"step": "1", "prune": true}',
        '{"step": 1, "prune": 1}',
        "[1, true]",
        "x" * 10_000,
    ):
        (trial / "verdict.json").write_text(text)
        assert read_verdict(tmp_path / "run") is None
    (trial / "reports.csv").unlink()
    secret = tmp_path / "secret.csv"
    secret.write_text("step,value\n1,0.5\n")
    os.symlink(secret, trial / "reports.csv")  # a planted link is not followed
    assert read_reports(tmp_path / "run") == []


def test_a_hostile_sweep_record_is_refused_or_reads_nothing_outside(tmp_path):
    pytest.importorskip("matplotlib")
    from multigpu.plots import plot_sweep

    sweeps = tmp_path / ".sweeps"
    sweeps.mkdir()
    (sweeps / "bad.json").write_text('{"family": "f", "trials": 5}')
    with pytest.raises(ConfigError, match="is not a sweep record"):
        plot_sweep(sweeps / "bad.json", tmp_path / "x.png")
    (tmp_path.parent / "outside.csv").write_text("step,value\n1,123456\n")
    record = {
        "family": "f",
        "metric": "m",
        "mode": "min",
        "params": {"x": {"kind": "uniform", "low": 0, "high": 1}},
        "trials": [
            {
                "run": "a",
                "values": {"x": 0.5},
                "state": "done",
                "value": 1.0,
                "reports": "../outside.csv",
            },
            {"run": "b", "values": {"x": "text"}, "state": "hacked", "value": 2.0, "reports": "b"},
        ],
    }
    (sweeps / "f.json").write_text(json.dumps(record))
    assert plot_sweep(sweeps / "f.json", tmp_path / "f.png").stat().st_size > 1000


# ------------------------------------------------------------------ a search's study


def test_a_study_is_continued_only_with_its_own_settings(tmp_path):
    pytest.importorskip("optuna")
    from multigpu.queue.search import Search

    runs = tmp_path / "runs.yaml"
    runs.write_text(family("{params: {lr: {uniform: [0, 1]}}}", "{trials: 2}"))
    (search,) = load_plan(runs).searches
    first = Search(search.entry, search.space, tmp_path / "out")
    assert first.start() == []
    with pytest.raises(ConfigError, match="being run by another queue"):
        Search(search.entry, search.space, tmp_path / "out").start()
    first.close()
    runs.write_text(family("{params: {lr: {uniform: [0, 2]}}}", "{trials: 2}"))
    (changed,) = load_plan(runs).searches
    with pytest.raises(ConfigError, match="changed since its study") as info:
        Search(changed.entry, changed.space, tmp_path / "out").start()
    assert "another --out" in info.value.hint
    runs.write_text(family("{params: {lr: {uniform: [0, 1]}}}", "{trials: 9, pruner: median}"))
    (more,) = load_plan(runs).searches
    # more trials, another pruner: the same study
    again = Search(more.entry, more.space, tmp_path / "out")
    assert again.start() == [] and again.wants_more()
    again.close()
