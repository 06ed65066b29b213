"""Property-based fuzzing of the readers of received checkpoint bytes: the manifest, the pickle scanner,
DCP metadata and the zip checker. Whatever the bytes, the answer is a value or a CheckpointError (one
line for the user) - never another exception, a crash, or a long wait. Each property is time-bounded
(a few hundred examples, a deadline per example) so the whole file takes seconds."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from multigpu.checkpoint.reading import check_manifest
from multigpu.checkpoint.untrusted import METADATA_LIMITS, check_zip, scan_pickle
from multigpu.errors import CheckpointError

FAST = settings(
    max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "size": st.integers(-5, 1 << 40) | json_values,
        "crc32": st.text("0123456789abcdefXYZ", max_size=9) | json_values,
        "xxh3": st.text("0123456789abcdef", max_size=17) | json_values,
    },
)
names = st.text(max_size=12) | st.sampled_from(
    [
        "state.pt",
        ".metadata",
        "extra.pt",
        "__0_0.distcp",
        "../x",
        "/etc/passwd",
        "a/../b",
        "x\u009b2J",
        "ok/sub.bin",
    ]
)
manifests = st.fixed_dictionaries(
    {},
    optional={
        "files": st.dictionaries(names, entries, max_size=5) | json_values,
        "sharded": st.booleans() | json_values,
        "step": json_values,
        "world_size": json_values,
        "epoch": json_values,
    },
)


@settings(
    max_examples=120, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(manifests | json_values)
def test_the_manifest_check_accepts_or_refuses_with_one_line(manifest):
    try:
        check_manifest(manifest, Path("ckpt/step-00000001/manifest.json"))
    except CheckpointError as exc:
        assert "\n" not in exc.one_line()
        return
    for name in manifest["files"]:  # accepted: every name a plain relative path
        assert not name.startswith("/") and ".." not in name.split("/")
    json.dumps(manifest)


def _real_pickles() -> list[bytes]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    state = {
        "model": model.state_dict(),
        "nested": {"list": [1, 2.5, "x", None, (1, 2)], "tied": [model[0].weight] * 2},
    }
    return [pickle.dumps(state, protocol=protocol) for protocol in (2, 4)] + [
        pickle.dumps([[{"a": (1,)}]] * 3)
    ]


REAL = _real_pickles()


@FAST
@given(
    st.sampled_from(range(len(REAL))),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
    st.integers(0, 10_000),
)
def test_the_pickle_scan_survives_mutations(which, flips, cut):
    data = bytearray(REAL[which])
    for at, value in flips:
        data[at % len(data)] = value
    data = bytes(data[: max(1, cut % (len(data) + 1))])
    try:
        scan_pickle(data, "fuzzed")
    except CheckpointError:
        pass


@FAST
@given(st.binary(max_size=4000))
def test_the_pickle_scan_survives_random_bytes(data):
    try:
        scan_pickle(data, "random", METADATA_LIMITS)
    except CheckpointError:
        pass


@pytest.fixture(scope="module")
def metadata_bytes(tmp_path_factory) -> bytes:
    from multigpu.checkpoint import sharded

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    step = sharded.save(
        tmp_path_factory.mktemp("fuzz") / "ckpt",
        3,
        model,
        opt,
        {},
        is_main=True,
        barrier=lambda: None,
    )
    return (step / ".metadata").read_bytes()


@settings(
    max_examples=150,
    deadline=3000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4))
def test_dcp_metadata_parsing_survives_mutations(metadata_bytes, flips):
    from multigpu.checkpoint.dcp_safe import check_metadata, parse_metadata

    data = bytearray(metadata_bytes)
    for at, value in flips:
        data[at % len(data)] = value
    try:
        metadata = parse_metadata(bytes(data), Path("ckpt/step-00000003/.metadata"))
        check_metadata(metadata, Path("ckpt/step-00000003"), {"__0_0.distcp": 1 << 20})
    except CheckpointError:
        pass


def _zip_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(10.0), "x": [1, 2, {"y": "z"}]}, buffer)
    return buffer.getvalue()


ZIP = _zip_bytes()


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
    st.integers(0, 1 << 16),
)
def test_the_zip_check_survives_mutations(flips, cut):
    data = bytearray(ZIP)
    for at, value in flips:
        data[at % len(data)] = value
    data = bytes(data[len(data) - (cut % len(data)) :]) if cut % 7 == 0 else bytes(data)
    try:
        check_zip(io.BytesIO(data), "fuzzed.pt")
    except CheckpointError:
        pass
