"""Hostile input for the settings of issue 27 - activation_checkpointing, profile, memory_snapshot_on_oom,
ema/swa_start, the skip_* guard - and for ``multigpu run --profile``'s variable.

Each setting passes the settings door: a bad value is one line naming the setting, with a HINT, on every
path a value comes in by (a YAML file's KEY=VALUE override, the Python API). The table runs in-process
(the door is the same code); two cases run as real processes to hold the promise end to end: a non-zero
exit, one ``multigpu: error: ... HINT: ...`` line, no traceback, nothing written. The files these
features read back - a checkpoint's averaged model and guard counters - are refused when malformed,
and a link planted where the profiler writes is never followed.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from conftest import PY, REPO, child_env
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg

pytestmark = pytest.mark.timeout(120)
DIGITS = str(REPO / "examples" / "digits" / "train.py")

CASES = [
    # (id, override, fragment of the error line)
    ("ac-number", "trainer.activation_checkpointing=3", "activation_checkpointing=3 is invalid"),
    (
        "ac-text",
        "trainer.activation_checkpointing=all",
        "activation_checkpointing='all' is invalid",
    ),
    (
        "ac-empty-mapping",
        "trainer.activation_checkpointing={}",
        "activation_checkpointing={} is invalid",
    ),
    (
        "ac-unknown-key",
        "trainer.activation_checkpointing={evry: 2}",
        "activation_checkpointing has no key 'evry'",
    ),
    (
        "ac-every-zero",
        "trainer.activation_checkpointing={every: 0}",
        "activation_checkpointing setting every=0",
    ),
    (
        "ac-every-huge",
        "trainer.activation_checkpointing={every: 99999999999}",
        "setting every=99999999999",
    ),
    ("ac-every-bool", "trainer.activation_checkpointing={every: true}", "setting every=True"),
    (
        "ac-blocks-text",
        "trainer.activation_checkpointing={blocks: Block}",
        "setting blocks='Block'",
    ),
    (
        "ac-blocks-empty",
        "trainer.activation_checkpointing={blocks: []}",
        "blocks=[] names no block",
    ),
    (
        "ac-block-name-code",
        "trainer.activation_checkpointing={blocks: ['__import__(\"os\")']}",
        "block name",
    ),
    (
        "ac-block-name-newline",
        'trainer.activation_checkpointing={blocks: ["A\\nB"]}',
        "control characters",
    ),
    (
        "ac-block-name-long",
        "trainer.activation_checkpointing={blocks: [" + "B" * 300 + "]}",
        "block name",
    ),
    ("profile-text", "trainer.profile=yes please", "profile='yes please' is invalid"),
    ("profile-list", "trainer.profile=[1, 1, 3]", "profile=[1, 1, 3] is invalid"),
    ("profile-unknown-key", "trainer.profile={wiat: 1}", "profile has no key 'wiat'"),
    ("profile-path-key", "trainer.profile={dir_name: /etc}", "profile has no key 'dir_name'"),
    ("profile-negative", "trainer.profile={wait: -1}", "profile setting wait=-1"),
    ("profile-active-zero", "trainer.profile={active: 0}", "profile setting active=0"),
    ("profile-active-huge", "trainer.profile={active: 1000000}", "profile setting active=1000000"),
    ("profile-float", "trainer.profile={warmup: 1.5}", "profile setting warmup=1.5"),
    ("profile-top-text", "trainer.profile={top: all}", "profile setting top='all'"),
    (
        "profile-memory-text",
        "trainer.profile={profile_memory: maybe}",
        "profile setting profile_memory='maybe'",
    ),
    ("oom-snapshot-text", "trainer.memory_snapshot_on_oom=sometimes", "memory_snapshot_on_oom"),
    ("ema-one", "trainer.ema=1", "ema=1.0 is invalid"),
    ("ema-above-one", "trainer.ema=1.5", "ema=1.5 is invalid"),
    ("ema-zero", "trainer.ema=0", "ema=0.0 is invalid"),
    ("ema-negative", "trainer.ema=-0.9", "ema=-0.9 is invalid"),
    ("ema-nan", "trainer.ema=.nan", "trainer.ema must be a finite number, not nan"),
    ("ema-text", "trainer.ema=high", "ema"),
    ("swa-zero", "trainer.swa_start=0", "swa_start=0 is invalid"),
    ("swa-float", "trainer.swa_start=2.5", "swa_start"),
    ("swa-and-ema", ["trainer.swa_start=10", "trainer.ema=0.99"], "swa_start=10 is invalid"),
    ("skip-text", "trainer.skip_nonfinite=please", "skip_nonfinite must be true or false"),
    ("skip-norm-zero", "trainer.skip_grad_norm_above=0", "skip_grad_norm_above=0.0 is invalid"),
    (
        "skip-norm-inf",
        "trainer.skip_grad_norm_above=.inf",
        "skip_grad_norm_above must be a finite number, not inf",
    ),
    (
        "skip-loss-nan",
        "trainer.skip_loss_above=.nan",
        "skip_loss_above must be a finite number, not nan",
    ),
    ("skip-in-a-row-zero", "trainer.max_skipped_in_a_row=0", "max_skipped_in_a_row=0 is invalid"),
    ("skip-in-a-row-huge", "trainer.max_skipped_in_a_row=1e12", "max_skipped_in_a_row"),
    ("skip-loss-huge", "trainer.skip_loss_above=1e300", "skip_loss_above=1e+300 is invalid"),
    # the settings of issue 52: where a run starts, the hang notice, the progress line's unit
    ("fresh-text", "trainer.fresh=maybe", "fresh must be true or false"),
    ("resume-from-list", "trainer.resume_from=[1]", "resume_from"),
    ("resume-from-escape", "trainer.resume_from=\x1b[2Jout", "resume_from"),
    ("notice-negative", "trainer.hang_notice_s=-1", "hang_notice_s=-1.0 is invalid"),
    ("notice-nan", "trainer.hang_notice_s=.nan", "hang_notice_s must be a finite number, not nan"),
    ("items-zero", "trainer.items_per_sample=0", "items_per_sample=0.0 is invalid"),
    ("unit-escape", "trainer.throughput_unit=\x1b[31mtokens", "throughput_unit"),
    ("unit-list", "trainer.throughput_unit=[tokens]", "throughput_unit"),
]


@dataclass
class Recipe:
    trainer: mg.TrainerSettings = field(default_factory=mg.TrainerSettings)


def test_the_table_is_unique():
    assert len({c[0] for c in CASES}) == len(CASES) >= 35


@pytest.mark.parametrize("override, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_setting_is_one_line_with_a_hint(override, expect):
    from multigpu import config
    from multigpu.errors import MultiGPUError

    with pytest.raises(MultiGPUError) as caught:
        config.load(Recipe, None, [override] if isinstance(override, str) else override)
    line = str(caught.value)
    assert "\n" not in line and "HINT:" in line and expect in line, line


@pytest.mark.parametrize(
    "settings, expect",
    [
        (
            {"activation_checkpointing": {"every": 2, "blocks": None, "extra": 1}},
            "has no key 'extra'",
        ),
        ({"profile": {"wait": True}}, "profile setting wait=True"),
        ({"ema": 0.999, "swa_start": 5}, "swa_start=5 is invalid"),
        ({"ema": float("inf")}, "ema=inf is invalid"),
    ],
)
def test_the_python_api_takes_the_same_door(settings, expect):
    from multigpu.errors import ConfigError

    with pytest.raises(ConfigError, match=expect):
        mg.TrainerSettings(**settings)


def test_run_setup_checks_activation_checkpointing_too():
    """A hand-written loop gives the setting to run.setup: the same door, before the model is touched."""
    from multigpu.errors import ConfigError

    run = mg.init(env={})
    with pytest.raises(ConfigError, match="activation_checkpointing has no key 'every_other'"):
        run.setup(nn.Linear(2, 2), activation_checkpointing={"every_other": True})


class _Fit(mg.Trainer):
    def compute_loss(self, batch):
        return F.mse_loss(self.model(batch[0]), batch[1])


def test_a_link_where_traces_go_is_refused(tmp_path):
    from multigpu.errors import ConfigError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "profile").symlink_to(elsewhere)
    with pytest.raises(
        ConfigError, match="holds a link or a file where the Trainer keeps one of its folders"
    ):
        _Fit(
            mg.init(env={}),
            nn.Linear(2, 2),
            lambda p: torch.optim.SGD(p, lr=0.1),
            out_dir=str(tmp_path / "out"),
            profile=True,
        )
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize(
    "state, expect",
    [
        ({"averaging": {"updates": "3"}, "averaged_model": {}}, "averaged model is malformed"),
        (
            {"averaging": {"updates": 3}, "averaged_model": ["not", "a", "dict"]},
            "averaged model is malformed",
        ),
        (
            {"averaging": {"updates": 3}, "averaged_model": {"weight": torch.zeros(5, 5)}},
            r"has no weight of shape \(2, 2\)",
        ),
        (
            {"averaging": {"updates": 3}, "averaged_model": {"weight": "rm -rf /"}},
            "has no weight of shape",
        ),
    ],
)
def test_a_malformed_averaged_model_in_a_checkpoint_is_one_line(tmp_path, state, expect):
    from multigpu.errors import CheckpointError

    trainer = _Fit(
        mg.init(env={}),
        nn.Linear(2, 2),
        lambda p: torch.optim.SGD(p, lr=0.1),
        out_dir=str(tmp_path),
        ema=0.9,
        skip_nonfinite=True,
        progress=False,
    )
    with pytest.raises(CheckpointError, match=expect) as caught:
        trainer.load_checkpoint_state(
            {"trainer": {"epoch": 0, "batch_in_epoch": 0, "global_step": 0}, **state}
        )
    assert "HINT:" in str(caught.value)
    # ignored, not trusted
    trainer.extras.load_state_dict({"step_guard": {"skipped": -4, "in_a_row": "x"}})
    assert trainer.extras.guard.skipped == 0 and trainer.extras.guard.in_a_row == 0


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (
            [DIGITS, "trainer.activation_checkpointing={every: -2}"],
            {},
            "activation_checkpointing setting every=-2",
        ),
        (
            ["-c", "import multigpu as mg; mg.init()"],
            {"MULTIGPU_JOB": '{"profile": "yes please"}'},
            "MULTIGPU_JOB setting profile='yes please' is invalid",
        ),
    ],
    ids=["setting", "environment"],
)
def test_as_a_real_process_one_line_no_traceback_nothing_written(tmp_path, argv, env, expect):
    before = sorted(tmp_path.rglob("*"))
    proc = subprocess.run(
        [PY, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=child_env({"HOME": str(tmp_path), **env}),
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("multigpu: error:")]
    assert len(errors) == 1 and "HINT:" in errors[0] and expect in errors[0], proc.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_a_trainer_with_everything_on_still_trains(tmp_path):
    """The settings together, valid: a control for the table above (every bad case fails at the door)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, 2, generator=g))
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    trainer = _Fit(
        mg.init(env={}),
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        out_dir=str(tmp_path),
        batch_size=4,
        activation_checkpointing={"every": 1, "blocks": ["Linear"]},
        ema=0.5,
        skip_nonfinite=True,
        skip_grad_norm_above=1e6,
        skip_loss_above=1e6,
        max_skipped_in_a_row=2,
        memory_snapshot_on_oom=True,
        progress=False,
        plot=False,
    )
    assert trainer.fit(data)[0]["train_loss"] > 0


def test_the_mapping_settings_are_values_or_one_line():
    """Property: whatever YAML gives activation_checkpointing or profile, the checker returns the one form
    the strategies and the profiler read, or raises one line."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from multigpu import validate
    from multigpu.errors import MultiGPUError
    from multigpu.trainer import options

    values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(["every", "blocks", "wait", "active", "top", "x"])
                | st.text(max_size=8),
                inner,
                max_size=4,
            )
        ),
        max_leaves=12,
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(values)
    def check(value):
        for checker in (validate.activation_checkpointing_settings, options.profile_settings):
            try:
                out = checker(value)
            except MultiGPUError as exc:
                assert "\n" not in exc.one_line() and "HINT:" in exc.one_line()
                continue
            # idempotent: checked twice
            assert out is False or (isinstance(out, dict) and checker(out) == out)

    check()
