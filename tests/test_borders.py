"""The borders with other libraries: every file, store and value handed to MLflow, TensorBoard, W&B, Optuna's
SQLite, torch's strategies and profiler, matplotlib and the environment passes a door of ours first.

One test per cause an outside audit found (2026-12), each a case that went wrong before its door; property
tests per border (store folders, study files, settings dicts, plot inputs); and registry checks that a new
store or setting cannot skip its door. docs/security.md lists the borders.
"""

from __future__ import annotations

import ast
import json
import os
import sqlite3
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import PY, REPO, child_env, multigpu
from hypothesis import HealthCheck, given, settings, strategies as st

from multigpu.errors import ConfigError, MultiGPUError
from multigpu.launch import environment
from multigpu.trainer import options

pytestmark = pytest.mark.timeout(240)
SRC = REPO / "src" / "multigpu"
FAST = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "precious.txt").write_text("keep me")
    return victim / "precious.txt"


# ------------------------------------------------------------------ 2. our examples write through the door


def test_the_digits_recipe_never_writes_through_a_link_planted_in_its_run_folder(tmp_path):
    """A received run folder whose config.yaml and final.json are links to someone's file: the recipe (one
    process, one epoch) replaces the links with its files and the linked file stays as it was."""
    precious = _victim(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.yaml", "final.json"):
        (out / name).symlink_to(precious)
    done = subprocess.run(
        [
            PY,
            str(REPO / "examples" / "digits" / "train.py"),
            str(REPO / "examples" / "digits" / "hparams.yaml"),
            f"trainer.out_dir={out}",
            f"data.folder={tmp_path / 'data'}",
            "trainer.epochs=1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert precious.read_text() == "keep me"
    assert not (out / "config.yaml").is_symlink() and "model:" in (out / "config.yaml").read_text()
    assert "accuracy" in json.loads((out / "final.json").read_text())


def test_write_file_replaces_a_link_and_refuses_a_fifo(tmp_path):
    import multigpu as mg

    precious = _victim(tmp_path)
    (tmp_path / "a.json").symlink_to(precious)
    mg.write_file(tmp_path / "a.json", b"{}")
    assert precious.read_text() == "keep me" and (tmp_path / "a.json").read_text() == "{}"
    mg.write_file(tmp_path / "new" / "deep.txt", "made")  # its folder is made
    assert (tmp_path / "new" / "deep.txt").read_text() == "made"


# ------------------------------------------------------------------ 3. stores other libraries write into


def test_a_link_planted_inside_the_mlflow_store_is_refused_before_mlflow_writes(
    tmp_path, monkeypatch
):
    pytest.importorskip("mlflow")
    from multigpu.loggers import MLflowLogger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    precious = _victim(tmp_path)
    run = tmp_path / "run"
    (run / "mlruns" / "0" / "abc" / "metrics").mkdir(parents=True)
    (run / "mlruns" / "0" / "abc" / "metrics" / "epoch").symlink_to(precious)
    with pytest.raises(ConfigError, match="link, FIFO, device or socket inside a store folder"):
        MLflowLogger(run)
    assert precious.read_text() == "keep me"


def test_an_mlflow_run_id_the_folder_did_not_start_is_not_logged_into(tmp_path, monkeypatch):
    """out/.mlflow_run_id naming another run of the store (another folder's): a new run for this folder."""
    pytest.importorskip("mlflow")
    from multigpu.loggers import MLflowLogger

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first = MLflowLogger(tmp_path / "a")
    store = (tmp_path / "a" / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)  # both folders log to one store
    second = MLflowLogger(tmp_path / "b")
    (tmp_path / "b" / ".mlflow_run_id").write_text(first.run_id)  # planted: a's run
    third = MLflowLogger(tmp_path / "b")
    assert (
        third.run_id not in (first.run_id, "")
        and (tmp_path / "b" / ".mlflow_run_id").read_text() == third.run_id
    )
    assert second.run_id != first.run_id
    # not an id MLflow makes: a new run
    (tmp_path / "b" / ".mlflow_run_id").write_text("../../etc/passwd")
    assert MLflowLogger(tmp_path / "b").run_id not in (first.run_id, "../../etc/passwd")


def test_tensorboard_and_wandb_stores_are_checked_whole(tmp_path):
    from multigpu.loggers import store_folder

    precious = _victim(tmp_path)
    (tmp_path / "run" / "tensorboard" / "deep").mkdir(parents=True)
    (tmp_path / "run" / "tensorboard" / "deep" / "events").symlink_to(precious)
    with pytest.raises(ConfigError, match="inside a store folder"):
        store_folder(tmp_path / "run", "tensorboard")
    os.mkfifo(tmp_path / "run" / "wandb-fifo")
    (tmp_path / "run" / "wandb").mkdir()
    os.mkfifo(tmp_path / "run" / "wandb" / "debug.log")
    with pytest.raises(ConfigError, match="inside a store folder"):
        store_folder(tmp_path / "run", "wandb")
    assert store_folder(tmp_path / "fresh", "tensorboard").path.is_dir()


NODES = st.recursive(
    st.sampled_from(["file", "link", "fifo"]),
    lambda inner: st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
    max_leaves=8,
)


def _build(folder: Path, node, victim: Path) -> bool:
    """Make the tree; True when it holds only folders and regular files."""
    if isinstance(node, dict):
        folder.mkdir(parents=True, exist_ok=True)
        return all([_build(folder / name, child, victim) for name, child in node.items()])
    if node == "file":
        folder.write_text("x")
    elif node == "link":
        folder.symlink_to(victim)
    else:
        os.mkfifo(folder)
    return node == "file"


@FAST
@given(NODES)
def test_a_store_is_refused_exactly_when_something_in_it_is_not_a_folder_or_a_file(
    tmp_path_factory, tree
):
    from multigpu.fileio import Folder, UnsafePath

    root = tmp_path_factory.mktemp("store")
    victim = _victim(root)
    clean = _build(root / "run" / "s", tree if isinstance(tree, dict) else {"x": tree}, victim)
    try:
        Folder(root / "run").store("s")
        assert clean
    except UnsafePath:
        assert not clean


# ------------------------------------------------------------------ 4. a received Optuna study file


def _study(folder: Path) -> Path:
    """A real study file made by this Optuna (the search's own name and folder)."""
    pytest.importorskip("optuna")
    import optuna

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "s.db"
    optuna.create_study(storage=f"sqlite:///{path}", study_name="s")
    return path


def _refused(path: Path, needle: str) -> None:
    from multigpu.queue.study_file import check_study

    with pytest.raises(ConfigError, match=needle) as caught:
        check_study(path)
    assert "HINT:" in caught.value.one_line() and "\n" not in caught.value.one_line()


def test_a_study_optuna_made_is_taken_and_a_missing_one_is_new(tmp_path):
    from multigpu.queue.study_file import check_study

    check_study(_study(tmp_path))
    check_study(tmp_path / "none.db")


@pytest.mark.parametrize(
    "plant, needle",
    [
        ("CREATE VIEW big AS SELECT zeroblob(1000000000)", "holds a view"),
        (
            "CREATE VIEW r AS WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c",
            "holds a view",
        ),
        (
            "CREATE TRIGGER t AFTER INSERT ON trials BEGIN DELETE FROM studies; END",
            "holds a trigger",
        ),
        ("CREATE TABLE extra (x)", "a table 'extra' that Optuna does not write"),
        ("ALTER TABLE trials ADD COLUMN planted TEXT", "as another Optuna version"),
        # an index whose expression allocates 500 MB per row the queue inserts (3.7 GB before this door)
        (
            "CREATE INDEX evil ON trials(length(printf('%.*c', 500000000, 'x')))",
            "an index 'evil' that Optuna does not write",
        ),
        (
            "UPDATE studies SET study_name = printf('%.*c', 2000000, 'x')",
            "holds a value of 2,000,000 bytes",
        ),
    ],
)
def test_a_study_with_what_optuna_never_writes_is_refused(tmp_path, plant, needle):
    path = _study(tmp_path)
    with sqlite3.connect(path) as connection:
        connection.execute(plant)
    _refused(path, needle)


def test_a_study_that_is_garbage_a_link_or_has_a_linked_journal_is_refused(tmp_path):
    garbage = tmp_path / "g.db"
    garbage.write_bytes(b"not sqlite at all" * 100)
    _refused(garbage, "is not a SQLite database")
    precious = _victim(tmp_path)
    linked = tmp_path / "l.db"
    linked.symlink_to(precious)
    _refused(linked, "is a link, FIFO or device")
    path = _study(tmp_path / "j")
    Path(str(path) + "-journal").symlink_to(precious)
    _refused(path, "its journal file")
    assert precious.read_text() == "keep me"


@FAST
@given(st.binary(max_size=600), st.integers(min_value=0, max_value=4000))
def test_a_mutated_study_file_is_taken_or_refused_with_one_line(tmp_path_factory, noise, where):
    """Random bytes written into a real study file: check_study answers with a ConfigError or nothing."""
    from multigpu.queue.study_file import check_study

    folder = tmp_path_factory.mktemp("mutated")
    path = _study(folder)
    data = bytearray(path.read_bytes())
    data[where : where + len(noise)] = noise
    path.write_bytes(bytes(data))
    try:
        check_study(path)
    except ConfigError as exc:
        assert "\n" not in exc.one_line()


def _search(tmp_path: Path, trials: int = 3):
    """A search of a runs file over x in [0, 1] with one trial asked and named, and a new Search of it."""
    pytest.importorskip("optuna")
    from multigpu.queue.plan import load_plan
    from multigpu.queue.search import Search

    runs = tmp_path / "runs.yaml"
    runs.write_text(
        "base:\n  script: s.py\n  out_dir_key: out_dir\na < base:\n"
        f"  sweep: {{params: {{x: {{uniform: [0, 1]}}}}}}\n  search: {{sampler: random, trials: {trials}}}\n"
    )
    (family,) = load_plan(runs).searches
    first = Search(family.entry, family.space, tmp_path / "out")
    first.start()
    first.ask()
    first.close()
    return Search(
        family.entry, family.space, tmp_path / "out"
    ), tmp_path / "out" / ".sweeps" / "a.db"


@pytest.mark.parametrize(
    "plant, needle",
    [
        # a trial that names another run's folder: its results would be overwritten (a finished run's)
        (
            "UPDATE trial_user_attributes SET value_json = '\"base\"' WHERE key = 'run'",
            "names the run 'base'",
        ),
        # JSON nested 200,000 deep where Optuna reads a study's attributes: its RecursionError
        (
            "UPDATE study_user_attributes SET value_json = printf('%.*c', 200000, '[')",
            "Optuna could not read",
        ),
        ("UPDATE trial_params SET distribution_json = 'not json'", "Optuna could not read"),
    ],
)
def test_what_optuna_reads_back_from_a_planted_study_is_one_line(tmp_path, plant, needle):
    again, path = _search(tmp_path)
    with sqlite3.connect(path) as connection:
        connection.execute(plant)
    with pytest.raises(ConfigError, match=needle) as caught:
        again.start()
    assert "\n" not in caught.value.one_line()


def test_a_study_with_more_trials_than_the_search_asks_for_is_refused(tmp_path):
    again, path = _search(tmp_path, trials=3)
    # 8 more trials, each a copy of the named one under its own number
    with sqlite3.connect(path) as connection:
        for number in range(1, 9):
            connection.execute(
                "INSERT INTO trials (number, study_id, state, datetime_start) "
                "SELECT ?, study_id, state, datetime_start FROM trials WHERE number = 0",
                (number,),
            )
            trial = connection.execute("SELECT max(trial_id) FROM trials").fetchone()[0]
            connection.execute(
                "INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json) "
                "SELECT ?, param_name, param_value, distribution_json FROM trial_params "
                "WHERE trial_id = 1",
                (trial,),
            )
            connection.execute(
                "INSERT INTO trial_user_attributes (trial_id, key, value_json) "
                "SELECT ?, key, value_json FROM trial_user_attributes WHERE trial_id = 1",
                (trial,),
            )
    with pytest.raises(ConfigError, match="more than its trials: 3"):
        again.start()


def test_a_parameter_read_back_outside_the_space_never_becomes_a_run(tmp_path):
    pytest.importorskip("optuna")
    from multigpu.queue.plan import load_plan
    from multigpu.queue.search import Search

    runs = tmp_path / "runs.yaml"
    runs.write_text(
        "base:\n  script: s.py\n  out_dir_key: out_dir\na < base:\n"
        "  sweep: {params: {x: {uniform: [0, 1]}}}\n  search: {sampler: random, trials: 3}\n"
    )
    (family,) = load_plan(runs).searches
    search = Search(family.entry, family.space, tmp_path / "out")
    search.start()
    search.ask()
    search.close()
    # a value of 7, with escapes
    with sqlite3.connect(tmp_path / "out" / ".sweeps" / "a.db") as connection:
        connection.execute("UPDATE trial_params SET param_value = 7.0")
    again = Search(family.entry, family.space, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"x=7.0, outside the search's uniform\(0, 1\)"):
        again.start()


# ------------------------------------------------------------------ 5. values handed to torch's strategies


@pytest.mark.parametrize(
    "name, options, needle",
    [
        ("ddp", {"bucket_cap_mb": "x" * 1200}, "bucket_cap_mb must be float"),
        ("ddp", {"bucket_cap_mb": 1e300}, "is outside"),
        ("ddp", {"find_unused_parameters": "yes"}, "must be true or false"),
        ("pipeline", {"split_points": "abc"}, "split_points must be a list"),
        ("pipeline", {"micro_batches": 0}, "is outside 1..4096"),
        ("fsdp", {"wrap": 5}, "wrap must be a list"),
        ("ft-ddp", {"timeout_s": -1}, "is outside"),
        ("ddp", "bad", "must be a mapping"),
    ],
)
def test_strategy_options_are_typed_and_bounded_before_torch_sees_them(name, options, needle):
    from multigpu.strategies import parse_options, spec

    with pytest.raises(ConfigError, match=needle):
        parse_options(spec(name), options)


@FAST
@given(
    st.sampled_from(["ddp", "fsdp", "hsdp", "fsdp+tp", "pipeline", "ddp+pipeline", "ft-ddp"]),
    st.dictionaries(
        st.sampled_from(
            [
                "bucket_cap_mb",
                "find_unused_parameters",
                "wrap",
                "stages",
                "split_points",
                "micro_batches",
                "timeout_s",
                "tp_plan",
                "cpu_offload",
                "nope",
            ]
        ),
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=30)
        | st.lists(st.integers() | st.text(max_size=5), max_size=3),
        max_size=3,
    ),
)
def test_any_options_dict_is_options_of_the_declared_types_or_one_line(name, options):
    import dataclasses
    import typing

    from multigpu.strategies import parse_options, spec

    try:
        parsed = parse_options(spec(name), options)
    except MultiGPUError:
        return
    hints = typing.get_type_hints(type(parsed))
    for field in dataclasses.fields(parsed):
        value = getattr(parsed, field.name)
        if hints[field.name] in (bool, int, float, str):
            assert type(value) is hints[field.name] or (
                hints[field.name] is float and type(value) is float
            ), field


# ------------------------------------------------------------------ 6. the profiler's schedule


def test_a_profiler_schedule_torch_crashes_on_is_refused_with_the_reason():
    with pytest.raises(MultiGPUError, match="with_stack: true needs a step of wait or warmup"):
        options.profile_settings(
            {"wait": 0, "warmup": 0, "active": 1, "repeat": 2, "with_stack": True}
        )
    assert (
        options.profile_settings({"wait": 0, "warmup": 1, "active": 1, "with_stack": True})[
            "warmup"
        ]
        == 1
    )


# ------------------------------------------------------------------ 7. plots of a sweep record


def _record(queue: Path, trials: list, params: dict) -> Path:
    (queue / ".sweeps").mkdir(parents=True, exist_ok=True)
    path = queue / ".sweeps" / "fam.json"
    path.write_text(
        json.dumps({"metric": "valid_loss", "mode": "min", "params": params, "trials": trials})
    )
    return path


def test_a_large_sweep_record_with_one_shared_reports_file_plots_with_bounded_labels(
    tmp_path, monkeypatch
):
    pytest.importorskip("matplotlib")
    from multigpu import plots

    trials = [
        {
            "run": f"t{i}",
            "values": {"x": f"v{i}"},
            "reports": "shared.csv",
            "state": "done",
            "value": i,
        }
        for i in range(8000)
    ]
    (tmp_path / "shared.csv").write_text("step,value\n" + "1,1.0\n" * 200_000)
    record = _record(tmp_path, trials, {"x": {"kind": "choice"}})
    reads = []
    real = plots._reports
    monkeypatch.setattr(plots, "_reports", lambda queue, rel: reads.append(rel) or real(queue, rel))
    out = plots.plot_sweep(record, tmp_path / "sweep.png")
    # read once for the five best trials
    assert out.stat().st_size > 1000 and reads == ["shared.csv"]


def test_mathtext_and_values_beyond_an_axis_in_a_record_still_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from multigpu import plots

    trials = [
        {
            "run": "$\\sqrt{x$",
            "values": {"$\\sqrt{x$": 1e308},
            "reports": "r.csv",
            "state": "done",
            "value": 1e308,
        },
        {
            "run": "b\x1b[2J",
            "values": {"$\\sqrt{x$": -1e308},
            "reports": "r.csv",
            "state": "pruned",
            "value": 2,
        },
        {
            "run": "c",
            "values": {"$\\sqrt{x$": 10**400},
            "reports": "r.csv",
            "state": "done",
            "value": 10**400,
        },
    ]
    (tmp_path / "r.csv").write_text("step,value\n1,1e308\n2,$\\sqrt{x$\n")
    record = _record(tmp_path, trials, {"$\\sqrt{x$": {"kind": "uniform", "low": 0, "high": 1}})
    assert plots.plot_sweep(record, tmp_path / "s.png").stat().st_size > 1000


@FAST
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "run": st.text(max_size=8),
                "values": st.dictionaries(
                    st.text(max_size=3),
                    st.none() | st.floats() | st.integers() | st.text(max_size=4),
                    max_size=2,
                ),
                "reports": st.text(max_size=6),
                "state": st.sampled_from(["done", "pruned"]),
                "value": st.none() | st.floats() | st.integers(),
            }
        ),
        max_size=6,
    ),
    st.dictionaries(
        st.text(max_size=3),
        st.fixed_dictionaries(
            {"kind": st.sampled_from(["grid", "choice", "uniform", "loguniform", "int"])}
        ),
        max_size=3,
    ),
)
def test_any_sweep_record_plots_or_is_one_line(tmp_path_factory, trials, params):
    pytest.importorskip("matplotlib")
    from multigpu import plots

    queue = tmp_path_factory.mktemp("record")
    try:
        plots.plot_sweep(_record(queue, trials, params), queue / "s.png")
    except MultiGPUError:
        pass


# ------------------------------------------------------------------ 8. environment values of allow-listed names


@pytest.mark.parametrize(
    "name, value, ok",
    [
        ("PYTHONHASHSEED", "x", False),
        ("PYTHONHASHSEED", "random", True),
        ("PYTHONHASHSEED", "4294967296", False),
        ("TORCH_DISTRIBUTED_DEBUG", "bogus", False),
        ("TORCH_DISTRIBUTED_DEBUG", "detail", True),
        ("OMP_NUM_THREADS", "0", False),
        ("OMP_NUM_THREADS", "8", True),
        ("NCCL_SOCKET_IFNAME", "^docker,lo", True),
        ("NCCL_SOCKET_IFNAME", "eth0; rm -rf", False),
        ("TORCH_LOGS", "+dynamo,ddp", True),
        ("TORCH_LOGS", "a b", False),
        ("WANDB_MODE", "offline", True),
        ("WANDB_MODE", "bogus", False),
        ("TOKENIZERS_PARALLELISM", "True", True),
    ],
)
def test_allow_listed_variables_take_only_values_of_their_type(name, value, ok):
    if ok:
        assert environment.env_value(name, value, ConfigError) == value
    else:
        with pytest.raises(ConfigError, match=f"environment variable {name}="):
            environment.env_value(name, value, ConfigError)


def test_every_allow_listed_name_has_a_typed_value():
    assert set(environment.ENV_ALLOWED) == set(environment.ENV_VALUES)
    assert all(rule.why for rule in environment.ENV_VALUES.values())


def test_a_runs_file_value_every_run_would_die_of_is_refused_when_the_file_is_read(tmp_path):
    from multigpu.queue.runs import load_runs

    runs = tmp_path / "runs.yaml"
    runs.write_text("a:\n  script: s.py\n  env: {PYTHONHASHSEED: x}\n")
    with pytest.raises(ConfigError, match="PYTHONHASHSEED='x' is not a whole number"):
        load_runs(runs)


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"TORCH_LOGS": "bogus"}, "TORCH_LOGS='bogus' is not what torch takes"),
        ({"TORCH_DISTRIBUTED_DEBUG": "bogus"}, "TORCH_DISTRIBUTED_DEBUG='bogus'"),
    ],
)
def test_the_launcher_names_a_value_every_rank_would_die_of(tmp_path, env, needle):
    (tmp_path / "s.py").write_text("")
    proc = multigpu("run", str(tmp_path / "s.py"), env=env, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert (
        proc.returncode == 2 and len(lines) == 1 and needle in lines[0] and "HINT:" in lines[0]
    ), proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ 9. Slurm's heterogeneous jobs


def test_slurm_status_takes_a_heterogeneous_job_in_squeue(monkeypatch):
    from multigpu.launch import slurm_state

    asked = []
    monkeypatch.setattr(slurm_state, "slurm_tool", lambda name: name)
    monkeypatch.setattr(
        slurm_state,
        "call",
        lambda args, timeout=60: SimpleNamespace(
            returncode=0, stdout="77+0\n77+1\n12_3\n9\n", stderr=""
        ),
    )
    monkeypatch.setattr(slurm_state, "job_infos", lambda job_id="": asked.append(job_id) or [])
    assert slurm_state._not_in_accounting_yet("me", {"9"}) == []
    assert asked == ["12", "77"]


# ------------------------------------------------------------------ 10. doctor's --out


def test_doctor_takes_an_output_folder_that_starts_with_a_dash(tmp_path):
    proc = multigpu("doctor", "--out=-x", "--sizes", "1", "--nproc", "1", cwd=tmp_path, timeout=180)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert (
        "multigpu doctor: 1 rank(s)" in proc.stdout
        and "multigpu: error" not in proc.stdout + proc.stderr
    )


# ------------------------------------------------------------------ no store or setting skips its door


def _calls(tree: ast.AST) -> set[str]:
    return {
        n.func.id if isinstance(n.func, ast.Name) else n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Name, ast.Attribute))
    }


def test_every_logger_opens_its_store_through_the_door():
    from multigpu import loggers

    tree = ast.parse((SRC / "loggers.py").read_text())
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for name, cls in loggers.BACKENDS.items():
        if name == "csv":
            continue
        assert name in loggers.STORES and "store_folder" in _calls(classes[cls.__name__]), name


def test_optuna_opens_a_study_only_after_its_door_and_strategies_parse_options_through_theirs():
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in (
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ):
            called = _calls(function)
            if "RDBStorage" in called and function.name != "optuna_schema":
                assert "check_study" in called, (
                    f"{path}: {function.name} opens a study without check_study"
                )
    text = "".join((SRC / "strategies" / "__init__.py").read_text().split())  # as laid out or not
    assert "entry.options(" not in text and "from_mapping(entry.options" in text


# ------------------------------------------------------------------ a runs file's values, handed to the recipe


@FAST
@given(
    st.text(max_size=12)
    | st.sampled_from(
        [
            "off",
            "on",
            "yes",
            "no",
            "null",
            "~",
            "007",
            "1e-3",
            "0x1f",
            "1_000",
            "true",
            "[1]",
            "{a: 1}",
            "a: b",
            "- x",
            "'q'",
            '"q"',
            "#c",
        ]
    )
)
def test_a_runs_file_string_reaches_the_recipe_as_the_same_string(value):
    """The queue writes each override as KEY=VALUE for the recipe's parser: `mode: "off"` arrived as False
    (YAML reads off as a boolean) and the recipe's HINT blamed the user."""
    from multigpu.config import format_value, parse_overrides

    if "\x00" in value or any(
        ord(c) < 32 or 0x7F <= ord(c) <= 0x9F or 0xD800 <= ord(c) <= 0xDFFF for c in value
    ):
        return  # control characters never reach an override (plain_text refuses them)
    assert parse_overrides([f"k={format_value(value)}"])["k"] == value
