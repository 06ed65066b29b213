"""Property tests: random and mutated YAML thrown at the config loader and the runs-file parser.

Whatever the text, the only exception allowed is ConfigError, within bounded time and memory.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from multigpu import config
from multigpu.errors import ConfigError
from multigpu.queue.runs import load_runs
from multigpu.trainer import TrainerSettings

SEEDS = [
    "net:\n  script: t.py\n  args: [a.yaml]\n  gpus: 1\n  overrides: {model.hidden: 64}\nbig < net:\n  overrides:\n    x: 2\n",
    "trainer:\n  epochs: 3\n  batch_size: 32\n  precision: bf16\nmodel: {hidden: 128, depth: 2}\n",
    "base: &b {x: 1, y: [1, 2, 3]}\nchild:\n  <<: *b\n  x: 2\n",
    "a: &a [1, 2]\nb: [*a, *a]\nc: !!binary aGVsbG8=\nd: 2020-01-01\ne: 1e-3\nf: ~\n",
]
YAML_ALPHABET = st.sampled_from(
    list(":-[]{},&*!|>'\"#%@`?<\n\t ") + list("abcxyz019.") + ["\x00", "\xff", "\u2028"]
)


@dataclasses.dataclass
class Model:
    hidden: int = 8
    depth: int = 2
    rate: float = 0.1


@dataclasses.dataclass
class Recipe:
    model: Model = dataclasses.field(default_factory=Model)
    trainer: TrainerSettings = dataclasses.field(default_factory=TrainerSettings)
    name: Optional[str] = None
    layers: list[int] = dataclasses.field(default_factory=list)


def _mutate(seed: str, data: st.DataObject) -> str:
    text = seed
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["insert", "delete", "duplicate", "replace"]))
        at = data.draw(st.integers(0, len(text)))
        if op == "insert":
            text = text[:at] + data.draw(st.text(YAML_ALPHABET, max_size=8)) + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + data.draw(st.integers(1, 10)) :]
        elif op == "duplicate":
            line_start = text.rfind("\n", 0, at) + 1
            line_end = text.find("\n", at)
            line = text[line_start : line_end if line_end >= 0 else len(text)]
            text = text[:line_start] + line + "\n" + text[line_start:]
        else:
            text = text[:at] + data.draw(st.text(YAML_ALPHABET, max_size=3)) + text[at + 3 :]
    return text


def _bounded(call) -> None:
    """Refused or read, within 2 s of this process's CPU time: other jobs on the machine do not count."""
    started = time.process_time()
    try:
        call()
    except ConfigError as exc:
        assert "\n" not in exc.one_line()
    assert time.process_time() - started < 2.0


@pytest.fixture(autouse=True)
def _memory_cap():
    """At most 1 GiB more address space than the process has now: a bomb that expands in memory ends
    in MemoryError (a failure: only ConfigError is allowed), not in swapping the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm_kib = next(
        int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")
    )
    cap = vm_kib * 1024 + (1 << 30)
    resource.setrlimit(
        resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard)
    )
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_mutated_yaml_only_raises_config_error(tmp_path_factory, data):
    text = _mutate(data.draw(st.sampled_from(SEEDS)), data)
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "f.yaml"
    path.write_text(text, errors="surrogateescape")
    _bounded(lambda: config.load(Recipe, path))
    _bounded(lambda: load_runs(path))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.text(YAML_ALPHABET, max_size=200))
def test_random_text_only_raises_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(text, errors="surrogateescape")
    _bounded(lambda: config.load(Recipe, path))
    _bounded(lambda: load_runs(path))
    _bounded(lambda: config.parse_overrides([f"model.hidden={text}", f"x.y={text}"]))


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_config_error(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fuzz") / "b.yaml"
    path.write_bytes(raw)
    _bounded(lambda: load_runs(path))


@pytest.mark.parametrize("depth", [6, 8, 12])
def test_alias_bombs_are_refused_in_milliseconds(tmp_path, depth):
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, depth)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    started = time.process_time()  # this process's CPU time: other jobs on the machine do not count
    with pytest.raises(ConfigError, match="expands to more than"):
        load_runs(path)
    assert time.process_time() - started < 0.5
