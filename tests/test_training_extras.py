"""Activation checkpointing, profiling, weight averaging and the step guard (issue 27).

In-process where no processes are needed (the arithmetic, the choices, one process's Trainer), and one
2-process launch (``tests/scripts/training_extras.py``, shared by the tests below it) for what only
several ranks show: fsdp shards, the agreement to skip a step that went wrong on one rank, resume.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import PY, REPO, SCRIPTS, child_env, kill_all, wait_until_gone
from torch import nn
from torch.utils.data import TensorDataset

pytestmark = pytest.mark.timeout(240)
N, D, BLOCKS = 256, 32, 8  # activations of one block's hidden layer: N x 4D float64 = 256 KiB


class Block(nn.Module):
    def __init__(self, width: int = D, factor: int = 4) -> None:
        super().__init__()
        self.up = nn.Linear(width, factor * width)
        self.down = nn.Linear(factor * width, width)
        # tests/scripts/training_extras.py's: 2, tanh
        self.act = torch.relu if factor == 4 else torch.tanh

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def blocks(n: int = BLOCKS, width: int = D) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(n)]).double()


def peak_cpu_bytes(step) -> int:
    """The most CPU memory torch held at once during ``step()``, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    held = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


# ------------------------------------------------------------------------------------------ activation checkpointing


def test_checkpointing_gives_the_same_gradients_with_less_memory():
    """Without checkpointing each block keeps its hidden activation (N x 4D) from forward to backward:
    BLOCKS of them at the start of backward. With it, backward recomputes one block at a time: its
    hidden output, the ReLU's and their two gradients - at most 4 such tensors. So the peak drops by at
    least (BLOCKS - 4) of them; gradients are equal bit for bit (the same operations, recomputed)."""
    from multigpu.strategies.checkpointing import apply, is_checkpointed

    x = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = {}
    for on in (False, True):
        model = blocks()
        names = [n for n, _ in model.named_parameters()]
        if on:
            assert len(apply(model, {"blocks": None, "every": 1})) == BLOCKS
            assert all(is_checkpointed(b) for b in model) and type(model[0]).__name__ == "Block"
        peak = peak_cpu_bytes(lambda model=model: model(x).square().sum().backward())
        results[on] = (peak, [p.grad for p in model.parameters()], names, list(model.state_dict()))
    (plain_peak, plain_grads, plain_names, plain_keys), (ac_peak, ac_grads, ac_names, ac_keys) = (
        results[False],
        results[True],
    )
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, ac_grads, strict=True))
    # nothing renamed: checkpoints load as before
    assert ac_names == plain_names and ac_keys == plain_keys
    hidden = N * 4 * D * 8
    assert plain_peak - ac_peak >= (BLOCKS - 4) * hidden, (plain_peak, ac_peak, hidden)


def test_which_blocks_are_checkpointed():
    from multigpu.errors import ConfigError
    from multigpu.strategies.checkpointing import apply, is_checkpointed

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks(6, 4)
            self.head = nn.Linear(4, 1)

    model = Net()
    apply(model, {"blocks": None, "every": 2})  # torchtitan's "every 2": blocks 2, 4, 6
    assert [is_checkpointed(b) for b in model.blocks] == [False, True] * 3
    assert not is_checkpointed(model.head)
    model = Net()
    apply(model, {"blocks": ["Linear"], "every": 1})  # by class name: every Linear, the head too
    assert sum(is_checkpointed(m) for m in model.modules()) == 13
    with pytest.raises(
        ConfigError, match="matches no submodule.*HINT: name classes of this model: Block"
    ):
        apply(Net(), {"blocks": ["Blok"], "every": 1})
    with pytest.raises(ConfigError, match="every=7 skips all 6 block"):
        apply(Net(), {"blocks": None, "every": 7})
    with pytest.raises(ConfigError, match="found no repeated blocks"):
        apply(nn.Linear(2, 2), {"blocks": None, "every": 1})


@pytest.mark.parametrize("strategy", ["single", "pipeline", "dp", "fsdp"])
def test_every_strategy_of_one_process_checkpoints_in_its_setup(strategy, tmp_path):
    """The Trainer's setting reaches each strategy's setup (ddp and fsdp on 2 processes: below)."""
    import multigpu as mg
    from multigpu.strategies.checkpointing import is_checkpointed

    run = mg.init(env={})
    model = blocks(4, 4)
    trainer = Regression(
        run,
        model,
        lambda p: torch.optim.SGD(p, lr=0.1),
        strategy=strategy,
        out_dir=str(tmp_path),
        activation_checkpointing={"every": 2},
        batch_size=4,
        progress=False,
        plot=False,
    )
    checkpointed = [
        is_checkpointed(m) for m in run.unwrap(trainer.model).modules() if isinstance(m, Block)
    ]
    assert checkpointed == [False, True, False, True], strategy


# ------------------------------------------------------------------------------------------ weight averaging


def _steps(model: nn.Module, n: int) -> list[list[torch.Tensor]]:
    """The weights after each of ``n`` SGD steps on fixed data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    weights = []
    for _ in range(n):
        model(torch.randn(8, 4, dtype=torch.float64, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights


@pytest.mark.parametrize("decay, start", [(0.9, None), (None, 3)])
def test_the_average_equals_the_hand_computed_one_and_torchs(decay, start):
    """EMA: avg_1 = w_1, avg_t = decay avg_(t-1) + (1 - decay) w_t; from step ``start``: the mean of the
    weights after steps start..t. In float64 the only difference to the hand computation is rounding."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from multigpu.trainer.averaging import WeightAverage

    model = blocks(2, 4)
    average = WeightAverage(model, decay=decay, start=start)
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay)) if decay else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    history = []
    for step in range(1, 9):
        model(torch.randn(8, 4, dtype=torch.float64, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append([p.detach().clone() for p in model.parameters()])
        average.update(step)
        if reference is not None:
            reference.update_parameters(model)
    if decay:
        hand = history[0]
        for weights in history[1:]:
            hand = [decay * a + (1 - decay) * w for a, w in zip(hand, weights)]
        assert average.updates == 8
        for mine, torchs in zip(average.averaged, reference.module.parameters()):
            assert torch.equal(mine, torchs.detach())  # the same foreach lerp as swa_utils
    else:
        kept = history[start - 1 :]
        hand = [sum(ws) / len(kept) for ws in zip(*kept)]
        assert average.updates == len(kept) == 6
    for mine, expected in zip(average.averaged, hand, strict=True):
        assert torch.allclose(mine, expected, rtol=0, atol=1e-13)


def test_swapped_weights_come_back_exactly_and_the_state_loads_into_a_plain_model():
    from multigpu.errors import CheckpointError
    from multigpu.trainer.averaging import WeightAverage

    model = blocks(2, 4)
    model.register_buffer("counter", torch.tensor(7.0))
    average = WeightAverage(model, decay=0.5)
    with average.swapped():  # nothing averaged yet: the model as it is
        pass
    for step, _ in enumerate(_steps(model, 3), start=1):
        average.update(step)
    own = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4, dtype=torch.float64)
    with average.swapped():
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), average.averaged))
        swapped_out = model(x)
    assert all(torch.equal(p, o) for p, o in zip(model.parameters(), own))
    state = average.state_dict()
    assert state["averaging"] == {"kind": "ema", "decay": 0.5, "start": None, "updates": 3}
    plain = blocks(2, 4)
    plain.register_buffer("counter", torch.tensor(0.0))
    # strict: parameters averaged, buffers the model's
    plain.load_state_dict(state["averaged_model"])
    assert torch.equal(plain(x), swapped_out) and plain.counter.item() == 7.0
    fresh = WeightAverage(blocks(2, 4), decay=0.5)
    assert fresh.load_state_dict(state) and fresh.updates == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.averaged, average.averaged))
    assert not fresh.load_state_dict({})
    with pytest.raises(CheckpointError, match="malformed"):
        fresh.load_state_dict({"averaging": {"updates": -1}, "averaged_model": {}})
    with pytest.raises(CheckpointError, match="has no 0.up.weight of shape"):
        WeightAverage(blocks(2, 3), decay=0.5).load_state_dict(state)


# ------------------------------------------------------------------------------------------ the step guard


def test_the_guard_skips_and_puts_the_loss_sum_back():
    from multigpu.errors import MultiGPUError
    from multigpu.trainer.settings import TrainState
    from multigpu.trainer.step_guard import StepGuard

    said: list[str] = []
    guard = StepGuard(
        grad_norm_above=10.0, loss_above=5.0, max_in_a_row=4, active=False, say=said.append
    )
    loss_sum, state, norm = torch.zeros((), dtype=torch.float64), TrainState(), torch.tensor(1.0)
    loss_sum += 2.0
    assert guard.check(loss_sum, 1, norm, state) == 0
    loss_sum += 1.0
    loss_sum += float("nan")  # two micro-batches, one NaN
    assert guard.check(loss_sum, 2, norm, state) == 2 and loss_sum.item() == 2.0
    loss_sum += 12.0  # mean 6 over 2 batches: above 5
    assert guard.check(loss_sum, 2, norm, state) == 2 and loss_sum.item() == 2.0
    loss_sum += 1.0
    assert guard.check(loss_sum, 1, torch.tensor(math.inf), state) == 1
    assert guard.skipped == 3 and guard.in_a_row == 3
    assert [line.split(": ", 2)[2] for line in said] == [
        "loss not finite on at least one rank (1 skipped so far)",
        "loss above skip_loss_above on at least one rank (2 skipped so far)",
        "gradient norm not finite on at least one rank (3 skipped so far)",
    ]
    loss_sum += 1.0
    with pytest.raises(
        MultiGPUError, match="training diverged: 4 optimizer steps in a row"
    ) as caught:
        guard.check(loss_sum, 1, torch.tensor(11.0), state)
    assert "gradient norm above skip_grad_norm_above" in str(caught.value) and "HINT:" in str(
        caught.value
    )


class Regression(__import__("multigpu").Trainer):
    poison_step: int = -1

    def compute_loss(self, batch):
        inputs, targets = batch
        loss = F.mse_loss(self.model(inputs), targets)
        return loss * float("nan") if self.state.global_step + 1 == self.poison_step else loss


def _data(n: int = 32, width: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(n, width, dtype=torch.float64, generator=g),
        torch.randn(n, width, dtype=torch.float64, generator=g),
    )


def test_a_skipped_step_leaves_no_trace_in_one_process(tmp_path):
    """Step 3's loss is NaN: the weights, the optimizer's momentum and the scheduler stay as after step 2,
    the epoch's loss leaves that batch out, and the step rows count it."""
    import multigpu as mg

    run = mg.init(env={})
    seen = {}

    class Watch(Regression):
        poison_step = 3

        def on_train_batch_end(self, step, loss):
            seen[step] = (
                [p.detach().clone() for p in self.model.parameters()],
                self.optimizer.param_groups[0]["lr"],
                loss.item(),
            )

    trainer = Watch(
        run,
        blocks(2, 4),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
        out_dir=str(tmp_path),
        batch_size=8,
        skip_nonfinite=True,
        log_every_n_steps=1,
        progress=False,
        plot=False,
    )
    history = trainer.fit(_data())
    assert all(torch.equal(a, b) for a, b in zip(seen[2][0], seen[3][0]))  # skipped: unchanged
    assert not all(torch.equal(a, b) for a, b in zip(seen[3][0], seen[4][0]))
    # the scheduler did not step either
    assert [seen[s][1] for s in (2, 3, 4)] == [0.025, 0.025, 0.0125]
    kept = [seen[s][2] for s in (1, 2, 4)]
    assert math.isnan(seen[3][2]) and history[0]["train_loss"] == pytest.approx(
        sum(kept) / 3, rel=1e-12
    )
    rows = list(csv.DictReader(open(tmp_path / "steps.csv")))
    assert [int(r["skipped_steps"]) for r in rows] == [0, 0, 1, 1]
    state = torch.load(
        next((tmp_path / "checkpoints").glob("step-*")) / "state.pt", weights_only=True
    )
    assert state["step_guard"] == {"skipped": 1, "in_a_row": 0}


def test_averaging_through_the_trainer_resumes_exactly_in_one_process(tmp_path):
    import multigpu as mg

    run = mg.init(env={})

    def fit(out: Path, epochs: int):
        trainer = Regression(
            run,
            blocks(2, 4),
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            out_dir=str(out),
            batch_size=8,
            epochs=epochs,
            shuffle=False,
            swa_start=2,
            progress=False,
            plot=False,
        )
        trainer.fit(_data(), _data(8))
        return trainer.extras.averaging

    straight = fit(tmp_path / "straight", 3)
    fit(tmp_path / "parts", 1)
    resumed = fit(tmp_path / "parts", 3)
    assert straight.updates == resumed.updates == 3 * 4 - 1
    assert all(torch.equal(a, b) for a, b in zip(straight.averaged, resumed.averaged))


# ------------------------------------------------------------------------------------------ profiling


def test_profiling_writes_a_trace_and_prints_the_top_operators_and_off_builds_nothing(
    tmp_path, capsys
):
    import multigpu as mg

    run = mg.init(env={})
    common = dict(batch_size=8, progress=False, plot=False, epochs=2)
    off = Regression(
        run,
        blocks(2, 4),
        lambda p: torch.optim.SGD(p, lr=0.1),
        out_dir=str(tmp_path / "off"),
        **common,
    )
    # the loop calls nothing per step
    assert off.extras.profiler is None and not off.extras.after_each_step
    off.fit(_data())
    assert not (tmp_path / "off" / "profile").exists()
    on = Regression(
        run,
        blocks(2, 4),
        lambda p: torch.optim.SGD(p, lr=0.1),
        out_dir=str(tmp_path / "on"),
        profile={"wait": 1, "warmup": 1, "active": 2, "top": 5},
        **common,
    )
    on.fit(_data())
    out = capsys.readouterr().out
    trace = tmp_path / "on" / "profile" / "rank0-step4.pt.trace.json"
    assert (
        f"multigpu: profile: steps 3-4 traced on every rank: {tmp_path / 'on' / 'profile'}/rank*-step4"
        in out
    )
    table = (
        out.split("top operators by self_cpu_time_total:\n", 1)[1]
        .split("Self CPU time total")[0]
        .splitlines()
    )
    assert "Name" in table[1] and len(table) == 3 + 5 + 1  # rule, header, rule, 5 operators, rule
    assert json.loads(trace.read_text())["traceEvents"]
    assert sorted(p.name for p in (tmp_path / "on" / "profile").iterdir()) == [
        "rank0-step4.pt.trace.json"
    ]


def test_the_profile_flag_reaches_the_world():
    import argparse

    from multigpu.cli import build_parser
    from multigpu.commands.launching import plan_run
    from multigpu.distributed.world import read_job
    from multigpu.launch.flags import RunFlags
    from multigpu.launch.local import worker_env

    args = build_parser().parse_args(
        ["run", "--nproc", "2", "--cpu", "--profile", str(SCRIPTS / "sleep_run.py")]
    )
    assert isinstance(args, argparse.Namespace) and args.profile
    env = worker_env(plan_run(args))
    assert read_job(env).profile and not read_job({}).profile
    assert "--profile" in RunFlags(profile=True).flags()


def test_an_out_of_memory_snapshot_goes_through_the_file_door(tmp_path):
    """The writer alone (the CUDA path itself: tests/test_training_extras.py::test_gpu_*)."""
    import pickle

    from multigpu.trainer.profiling import snapshot_on_oom, write_snapshot

    path = write_snapshot(tmp_path, 3, {"segments": [], "device_traces": []})
    assert path == tmp_path / "profile" / "memory-snapshot-rank3.pickle"
    assert pickle.loads(path.read_bytes()) == {"segments": [], "device_traces": []}
    said: list[str] = []
    with snapshot_on_oom(tmp_path, 0, torch.device("cpu"), said.append):
        pass
    assert said == [
        "multigpu: memory_snapshot_on_oom records CUDA allocations; this run is on the cpu: no snapshot"
    ]


# ------------------------------------------------------------------------------------------ two processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, str]:
    """tests/scripts/training_extras.py on 2 processes with ``--profile`` (every fit in it is traced)."""
    out = tmp_path_factory.mktemp("extras")
    try:
        proc = subprocess.run(
            [
                PY,
                "-m",
                "multigpu",
                "run",
                "--nproc",
                "2",
                "--profile",
                "--tee-prefix",
                "never",
                str(SCRIPTS / "training_extras.py"),
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=200,
            env=child_env(),
            cwd=str(REPO),
        )
    finally:
        left = wait_until_gone(str(out), timeout=15)
        kill_all(left)
    assert not left, f"processes left behind: {left}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def _load(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt", weights_only=True)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpointing_changes_no_number_under_fsdp_and_ddp_and_resume_is_exact(two_ranks):
    """fsdp: 2 epochs straight without checkpointing = 1 epoch with it, then resumed with it (the model
    and its average, bit for bit); ddp: with and without, straight."""
    out, stdout = two_ranks
    for plain, checkpointed, expected in (("fsdp", "resumed", 4), ("ddp", "ddp_ac", 2)):
        first, second = _load(out, plain), _load(out, checkpointed)
        assert _equal(first["final"], second["final"]) and _equal(
            first["averaged"], second["averaged"]
        )
        for rank in (0, 1):
            assert (
                len(
                    json.loads((out / f"{checkpointed}-rank{rank}.json").read_text())[
                        "checkpointed"
                    ]
                )
                == expected
            )
    assert (
        "resumed from" in stdout
        and json.loads((out / "resumed-rank1.json").read_text())["skipped"] == 1
    )


def test_a_nan_on_one_rank_skips_the_step_on_both(two_ranks):
    out, stdout = two_ranks
    for name in ("fsdp", "ddp"):
        assert [
            json.loads((out / f"{name}-rank{r}.json").read_text())["skipped"] for r in (0, 1)
        ] == [1, 1]
    steps = _load(out, "fsdp")["steps"]
    assert len(steps) == 12 and _equal(steps[1], steps[2]) and not _equal(steps[2], steps[3])
    said = "multigpu: skipped step 3: loss not finite, gradient norm not finite on at least one rank (1 skipped so far)"
    assert stdout.count(said) == 4  # fsdp, half, ddp, ddp_ac (resumed starts after step 3)
    rows = list(csv.DictReader(open(out / "fsdp" / "metrics.csv")))
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)


def test_the_sharded_average_equals_the_hand_computed_ema_and_loads_into_a_plain_model(two_ranks):
    """fsdp: each rank averages its shards; gathered, they equal the EMA computed here from the full
    weights after every step (step 3 skipped: no update), in float64 up to rounding."""
    out, _ = two_ranks
    run = _load(out, "fsdp")
    hand = None
    for step, weights in enumerate(run["steps"], start=1):
        if step == 3:
            continue
        hand = (
            dict(weights) if hand is None else {k: 0.9 * hand[k] + 0.1 * weights[k] for k in hand}
        )
    assert hand.keys() == run["averaged"].keys()
    for key in hand:
        assert torch.allclose(run["averaged"][key], hand[key], rtol=0, atol=1e-13), key
    (last,) = sorted((out / "fsdp" / "checkpoints").glob("step-00000012"))
    rows = list(csv.DictReader(open(out / "fsdp" / "metrics.csv")))
    model = nn.Sequential()
    model.blocks = nn.Sequential(*[Block(8, 2) for _ in range(4)])
    model.head = nn.Linear(8, 1)
    model = model.double()
    model.load_state_dict(run["averaged"])  # strict: a plain model
    inputs, targets = run["valid"]
    with torch.no_grad():
        expected = F.mse_loss(model.head(model.blocks(inputs)), targets[:, None]).item()
    # validated on the average
    assert float(rows[-1]["valid_loss"]) == pytest.approx(expected, rel=1e-12)
    assert _equal(run["before_eval"], run["after_eval"]) and _equal(run["after_eval"], run["final"])
    # a sharded checkpoint: the averaged model is whole
    extra = torch.load(last / "extra.pt", weights_only=True)
    assert extra["averaging"] == {"kind": "ema", "decay": 0.9, "start": None, "updates": 11}
    assert _equal(extra["averaged_model"], run["averaged"])


def test_one_process_resumes_the_two_process_average(two_ranks, tmp_path):
    """The fsdp checkpoint of 2 ranks, resumed by 1 (fsdp in a world of one): its average, whole."""
    import shutil

    import multigpu as mg

    out, _ = two_ranks
    shutil.copytree(out / "fsdp", tmp_path / "fsdp")
    model = nn.Sequential()
    model.blocks = nn.Sequential(*[Block(8, 2) for _ in range(4)])
    model.head = nn.Linear(8, 1)
    trainer = Regression(
        mg.init(env={}),
        model.double(),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        strategy="fsdp",
        out_dir=str(tmp_path / "fsdp"),
        ema=0.9,
        skip_nonfinite=True,
        progress=False,
    )
    assert (
        trainer.resume()
        and trainer.extras.averaging.updates == 11
        and trainer.extras.guard.skipped == 1
    )
    averaged = dict(
        zip(
            [n for names in trainer.extras.averaging.names for n in names[:1]],
            trainer.extras.averaging.averaged,
        )
    )
    assert _equal(averaged, _load(out, "fsdp")["averaged"])


def test_every_rank_writes_its_trace_and_rank_0_names_them(two_ranks):
    out, stdout = two_ranks
    for rank in (0, 1):
        assert json.loads(
            (out / "fsdp" / "profile" / f"rank{rank}-step5.pt.trace.json").read_text()
        )["traceEvents"]
    assert (
        f"multigpu: profile: steps 3-5 traced on every rank: {out / 'fsdp' / 'profile'}/rank*-step5"
        in stdout
    )
    # resumed at step 6: named by the run's step
    assert (out / "half" / "profile" / "rank1-step11.pt.trace.json").exists()
    assert stdout.count("top operators by self_cpu_time_total") == 5


# ------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible (CI has none)")
def test_gpu_checkpointing_lowers_the_peak_memory():
    from multigpu.strategies.checkpointing import apply

    x = torch.randn(4 * N, D, dtype=torch.float64, device="cuda")
    peaks = {}
    for on in (False, True):
        model = blocks().cuda()
        if on:
            apply(model, {"blocks": None, "every": 1})
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).square().sum().backward()
        torch.cuda.synchronize()
        peaks[on] = torch.cuda.max_memory_allocated() - base
    assert peaks[False] - peaks[True] >= (BLOCKS - 4) * 4 * N * 4 * D * 8, peaks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible (CI has none)")
def test_gpu_out_of_memory_writes_a_snapshot(tmp_path):
    """A step that asks for far more than the GPU has: the run fails with the snapshot written first."""
    proc = subprocess.run(
        [
            PY,
            "-m",
            "multigpu",
            "run",
            "--gpus",
            "0",
            str(SCRIPTS / "training_extras_oom.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=str(REPO),
    )
    assert proc.returncode != 0
    snapshot = tmp_path / "profile" / "memory-snapshot-rank0.pickle"
    assert "memory snapshot in" in proc.stderr and snapshot.stat().st_size > 0
    import pickle

    assert "segments" in pickle.loads(snapshot.read_bytes())
