"""Property tests of every reader of outside input beyond YAML (tests/test_fuzz_config.py): KEY=VALUE
overrides, the settings door, the environment door, metrics CSV and status.json read back, names
inside a folder, Slurm values, the terminal door. Whatever the input: only our one-line errors (a
MultiGPUError) or a value, fast - never another exception, never a control character printed raw.
Time-bounded: a fixed number of examples each, no deadline flakes (hypothesis' deadline is off and
each test has a pytest timeout).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from multigpu import config, validate
from multigpu.errors import MultiGPUError, shown, visible
from multigpu.fileio import Folder, UnsafePath
from multigpu.launch import environment
from multigpu.loggers import read_csv
from multigpu.queue.run_folder import read_status
from multigpu.trainer import options
from multigpu.trainer.settings import SETTING_RULES, TrainerSettings

pytestmark = pytest.mark.timeout(120)  # each property: a few hundred examples, ~1-5 s here
FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ANY_TEXT = st.text(max_size=60)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
STEERING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@FAST
@given(st.lists(ANY_TEXT, max_size=5))
def test_overrides_are_values_or_one_line(items):
    try:
        parsed = config.parse_overrides(items)
    except MultiGPUError:
        return
    assert isinstance(parsed, dict)


@FAST
@given(st.sampled_from(sorted(SETTING_RULES)), VALUES)
def test_every_trainer_setting_is_checked_whatever_the_value(name, value):
    try:
        settings_ = TrainerSettings(**{name: value})
    except MultiGPUError as exc:
        assert len(exc.one_line()) <= 2000 and "\n" not in exc.one_line()
        return
    rule = SETTING_RULES[name]
    assert (
        validate.checked("trainer", name, getattr(settings_, name), rule) is not None
        or rule.optional
    )


@FAST
@given(VALUES)
def test_compile_settings_never_pass_a_string_option(value):
    try:
        checked = options.compile_settings({"options": value} if isinstance(value, dict) else value)
    except MultiGPUError:
        return
    if isinstance(checked, dict):
        assert all(isinstance(v, bool) for v in checked.get("options", {}).values())


@FAST
@given(
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=30)
)
def test_the_environment_door_lets_through_exact_names_only(name):
    try:
        environment.env_allowed(name)
    except MultiGPUError:
        return
    assert name in environment.ENV_ALLOWED


@FAST
@given(
    st.dictionaries(
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=20),
        st.text(max_size=10),
        max_size=6,
    )
)
def test_credentials_never_reach_a_run_whose_endpoint_came_from_a_file(from_file):
    inherited = {"WANDB_API_KEY": "secret", "HF_TOKEN": "secret", "HOME": "/home/u"}
    env, held = environment.run_environment(inherited, from_file)
    if any(part in name for name in from_file for part in environment.ENV_ENDPOINT_PARTS):
        assert all(
            env.get(name) != "secret" or name in from_file for name in ("WANDB_API_KEY", "HF_TOKEN")
        )
        assert "HOME" in env


@FAST
@given(st.binary(max_size=300))
def test_metrics_csv_and_status_read_back_are_rows_or_nothing(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("run")
    (folder / "metrics.csv").write_bytes(data)
    (folder / "status.json").write_bytes(data)
    rows = read_csv(folder / "metrics.csv")
    assert all(isinstance(row, dict) for row in rows)
    status = read_status(folder)
    assert all(
        isinstance(status[k], kind)
        for k, kind in (("state", str), ("exit_code", int), ("started", float))
        if k in status
    )


@FAST
@given(
    st.dictionaries(
        st.sampled_from(["state", "exit_code", "started", "ended", "fingerprint", "job_id", "x"]),
        VALUES,
        max_size=6,
    )
)
def test_status_fields_are_typed_whatever_json_holds(tmp_path_factory, fields):
    folder = tmp_path_factory.mktemp("run")
    (folder / "status.json").write_text(json.dumps(fields, default=str))
    status = read_status(folder)
    assert set(status) <= {
        "state",
        "exit_code",
        "started",
        "ended",
        "slots",
        "share",
        "fingerprint",
        "job_id",
    }
    assert not isinstance(status.get("exit_code"), bool)


@FAST
@given(ANY_TEXT)
def test_names_inside_a_folder_never_leave_it(tmp_path_factory, name):
    root = Folder(tmp_path_factory.mktemp("root"))
    try:
        root.write_atomic(name, "x")
    except (UnsafePath, OSError):
        return
    written = [p for p in root.path.rglob("*") if p.is_file()]
    assert all(root.path in p.parents for p in written)


@FAST
@given(st.text(max_size=40), st.text(max_size=40))
def test_slurm_values_never_reach_a_script_unchecked(time_value, extra):
    from multigpu.launch.slurm_options import SlurmOptions

    try:
        options = SlurmOptions(time=time_value or None, extra=(extra,) if extra else ())
        options.validate()
    except MultiGPUError:
        return
    for value in (time_value, extra):
        assert "\n" not in value and "\r" not in value


@FAST
@given(st.text(max_size=200))
def test_nothing_printed_from_outside_steers_the_terminal(text):
    assert not STEERING.search(visible(text))
    assert not STEERING.search(shown(text)) and len(shown(text)) <= 90
    assert "\n" not in MultiGPUError(text, text).one_line()
