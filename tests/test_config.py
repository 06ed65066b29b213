"""YAML settings into dataclasses: overrides, types, and errors that name the file, line and key."""

from dataclasses import dataclass, field
from typing import Optional

import pytest

from multigpu import config
from multigpu.config import yaml_file
from multigpu.errors import ConfigError
from multigpu.trainer import TrainerSettings


@dataclass
class Inner:
    hidden: int = 8
    rate: float = 0.5


@dataclass
class Outer:
    name: str = "net"
    inner: Inner = field(default_factory=Inner)
    layers: list[int] = field(default_factory=lambda: [1, 2])
    note: Optional[str] = None
    flag: bool = False
    trainer: TrainerSettings = field(default_factory=TrainerSettings)


def _write(tmp_path, text):
    path = tmp_path / "h.yaml"
    path.write_text(text)
    return path


def test_load_with_nested_values_and_overrides(tmp_path):
    path = _write(
        tmp_path, "name: big\ninner:\n  hidden: 32\nlayers: [3, 4]\ntrainer:\n  epochs: 4\n"
    )
    cfg = config.load(
        Outer, path, ["inner.rate=1e-3", "flag=true", "trainer.batch_size=16", "note=hello"]
    )
    assert (cfg.name, cfg.inner.hidden, cfg.inner.rate, cfg.layers, cfg.flag) == (
        "big",
        32,
        0.001,
        [3, 4],
        True,
    )
    assert (cfg.trainer.epochs, cfg.trainer.batch_size, cfg.note) == (4, 16, "hello")


def test_unknown_key_names_file_line_and_nearest_key(tmp_path):
    path = _write(tmp_path, "name: x\ninner:\n  hiden: 3\n")
    with pytest.raises(ConfigError) as info:
        config.load(Outer, path)
    assert f"{path}:3: unknown key 'inner.hiden'" in str(info.value)
    assert "did you mean 'inner.hidden'?" in str(info.value)


def test_wrong_type_names_file_line_and_type(tmp_path):
    path = _write(tmp_path, "name: x\n\ninner:\n  hidden: lots\n")
    with pytest.raises(ConfigError) as info:
        config.load(Outer, path)
    assert f"{path}:4: inner.hidden must be int, not 'lots'" in str(info.value)


def test_unknown_override_is_an_error(tmp_path):
    with pytest.raises(
        ConfigError, match="unknown key 'trainer.epoch'.*did you mean 'trainer.epochs'"
    ):
        config.load(Outer, None, ["trainer.epoch=3"])
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        config.load(Outer, None, ["trainer.epochs"])


def test_invalid_trainer_value_is_an_error():
    with pytest.raises(ConfigError, match="accumulate=0 is invalid"):
        config.load(Outer, None, ["trainer.accumulate=0"])


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = _write(tmp_path, "name: x\ninner: [1,\n")
    with pytest.raises(ConfigError, match=r"h.yaml:\d+: invalid YAML"):
        config.load(Outer, path)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(Outer, tmp_path / "nope.yaml")


def test_dump_round_trips(tmp_path):
    cfg = config.load(Outer, None, ["inner.hidden=5"])
    path = _write(tmp_path, config.dump_yaml(cfg))
    assert config.load(Outer, path) == cfg


def test_merge_is_deep():
    assert config.merge({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 3}}) == {
        "a": {"b": 3, "c": 2},
        "d": 1,
    }


def test_sequence_and_optional_sequence_fields():
    from typing import Sequence

    @dataclass
    class WithSequence:
        names: Optional[Sequence[str]] = None

    assert config.from_mapping(WithSequence, {"names": ["a", "b"]}).names == ["a", "b"]
    assert config.from_mapping(WithSequence, {"names": None}).names is None


def test_config_hash_ignores_memory_addresses():
    from multigpu.guards.consistency import config_hash

    assert config_hash({"fn": lambda: 1, "tags": {"b", "a"}}) == config_hash(
        {"fn": lambda: 2, "tags": {"a", "b"}}
    )
    assert config_hash({"lr": 0.1}) != config_hash({"lr": 0.2})


def test_a_config_difference_between_ranks_is_named_down_to_the_setting():
    import dataclasses

    from multigpu.guards.consistency import compare, config_items

    @dataclasses.dataclass
    class Model:
        hidden: int = 64

    rank0 = config_items(
        "trainer_settings", {"out_dir": "/tmp/a", "lr": 0.1, "model": Model(), "fn": lambda: 1}
    )
    rank1 = config_items(
        "trainer_settings", {"out_dir": "/tmp/b", "lr": 0.1, "model": Model(128), "fn": lambda: 2}
    )
    assert compare([rank0, rank1]) == [
        "trainer_settings.model.hidden: rank 0 = 64, rank 1 = 128",
        "trainer_settings.out_dir: rank 0 = '/tmp/a', rank 1 = '/tmp/b'",
    ]
    from pathlib import Path

    assert compare(
        [
            config_items("c", {"data": Path("/data/v1")}),
            config_items("c", {"data": Path("/data/v2")}),
        ]
    )
    huge = config_items("config", {f"k{i}": i for i in range(1000)})
    assert list(huge) == ["config"]  # too many keys: one hash, the all-gather stays small


@pytest.mark.parametrize("value", ["1_000", "0x10", "010", "20:00:00", "0b11", "-1_0"])
def test_yaml_whole_numbers_are_base_10_digits_only(value):
    """YAML 1.1 reads these as ints (1000, 16, 8, 72000, 3); a setting in another form is one line."""
    with pytest.raises(ConfigError) as info:
        yaml_file.parse_yaml(f"trainer:\n  epochs: {value}\n", "h.yaml")
    assert info.value.one_line().startswith("multigpu: error: h.yaml:2: ") and "HINT:" in str(
        info.value
    )
    assert yaml_file.parse_yaml(f"name: '{value}'\nepochs: 12\nlow: -3\n")[0] == {
        "name": value,
        "epochs": 12,
        "low": -3,
    }


@pytest.mark.parametrize(
    "items, needle, hint",
    [
        (["+model.hidden=8"], "Hydra's + adds a key", "write 'model.hidden=8'"),
        (["~model.hidden"], "Hydra's ~ deletes a key", "leave the override out"),
        (
            ["lr=1e-3,3e-3", "--multirun"],
            "--multirun is Hydra's sweep switch",
            "multigpu queue runs.yaml --sweep",
        ),
    ],
)
def test_hydra_habits_are_one_line_naming_what_says_it_here(items, needle, hint):
    with pytest.raises(ConfigError) as caught:
        config.parse_overrides(items)
    assert needle in caught.value.message and hint in caught.value.hint


def test_a_list_of_values_for_a_number_points_to_the_queue_s_sweep():
    @dataclass
    class Recipe:
        lr: float = 0.1

    with pytest.raises(ConfigError, match="lr must be a number, not '1e-3,3e-3'") as caught:
        config.load(Recipe, None, ["lr=1e-3,3e-3"])
    assert "multigpu queue runs.yaml --sweep 'lr=1e-3,3e-3'" in caught.value.hint
