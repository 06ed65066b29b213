"""Checkpoint cost side by side: torch.save, DCP, Lightning Fabric, Accelerate and multigpu (sync and async).

    python benchmarks/checkpoint_save.py [--params 20e6] [--repeats 5] [--steps 8] [--dir /tmp]

Run it in a virtual environment with the peers installed (never runtime dependencies of multigpu)::

    python3 -m venv /tmp/benchvenv
    /tmp/benchvenv/bin/pip install torch==2.13.0 numpy lightning==2.6.6 accelerate==1.15.0 -e .
    /tmp/benchvenv/bin/python benchmarks/checkpoint_save.py

The state is a model of --params float32 parameters (8 square Linear layers) and its AdamW state (3x
the model in all). Every measurement is a fresh process (so memory figures do not carry over), the
methods interleaved in a rotating order, medians printed. Per method:

- ``save``: the call until the checkpoint is durable (asynchronous ones: the call and the wait for it);
- ``stall``: how long the training loop was blocked by the call (synchronous: all of it);
- ``lost``: training time lost per checkpoint: ``--steps`` training steps run right after the call (for
  asynchronous saves: while the write goes on), then the wait for the write; minus ``--steps`` times the
  step time measured before - contention for cores and the GIL counts here;
- ``extra MiB``: the process's peak resident memory during the save above what it held before.

Which ones fsync: torch.save+fsync, DCP (sync_files=True) and multigpu; torch.save alone, Fabric and
Accelerate leave the data in the page cache (cheaper, not durable).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = [
    "torch.save",
    "torch.save+fsync",
    "dcp.save",
    "dcp.save 2 threads",
    "dcp.async_save",
    "fabric.save",
    "accelerate.save_state",
    "multigpu",
    "multigpu async",
    "multigpu sharded",
    "multigpu sharded async",
]
ASYNC = {"dcp.async_save", "multigpu async", "multigpu sharded async"}


# ----------------------------------------------------------------------------------------- one measurement


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    # "5": reset the peak RSS (VmHWM) of this process
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def measure(method: str, params: int, steps: int, folder: Path) -> dict:
    import torch
    from torch import nn

    torch.manual_seed(0)
    width = int(math.sqrt(params / 8))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(8, width)

    def train_step() -> None:
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    save, finish = _method(method, model, optimizer, folder)
    train_step()
    step_times = []
    for _ in range(5):
        started = time.perf_counter()
        train_step()
        step_times.append(time.perf_counter() - started)
    step_s = statistics.median(step_times)
    # the peak below counts buffers a method keeps from one save to the next
    before_kb = _rss_kb("VmRSS:")
    _reset_peak()
    save(0)  # warm: first-call costs (imports, group creation) are not a checkpoint's cost
    finish()
    started = time.perf_counter()
    save(1)
    finish()
    saved = time.perf_counter() - started
    peak_kb = _rss_kb("VmHWM:")
    started = time.perf_counter()
    save(2)
    stall = time.perf_counter() - started
    for _ in range(steps):
        train_step()
    finish()
    lost = time.perf_counter() - started - steps * step_s
    return {
        "method": method,
        "save_s": saved,
        "stall_s": stall,
        "lost_s": lost,
        "extra_mib": (peak_kb - before_kb) / 1024,
        "step_s": step_s,
    }


def _method(method: str, model, optimizer, folder: Path):  # noqa: C901 - one branch per tool, as they are used
    import torch

    done = [lambda: None]

    def finish() -> None:
        done[0]()
        done[0] = lambda: None

    if method.startswith("torch.save"):

        def save(step: int) -> None:
            with open(folder / f"plain-{step}.pt", "wb") as handle:
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, handle
                )
                if method.endswith("fsync"):
                    handle.flush()
                    os.fsync(handle.fileno())

        return save, finish
    if method.startswith("dcp."):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        def save(step: int) -> None:
            model_state, optim_state = get_state_dict(model, [optimizer])
            state = {"model": model_state, "optimizer": optim_state}
            if method == "dcp.save":
                dcp.save(state, checkpoint_id=str(folder / f"dcp-{step}"))
            # what multigpu's sharded save asks of DCP (its default is 1)
            elif method == "dcp.save 2 threads":
                dcp.save(
                    state,
                    storage_writer=dcp.FileSystemWriter(
                        str(folder / f"dcp-{step}"), sync_files=True, thread_count=2
                    ),
                )
            else:
                future = dcp.async_save(state, checkpoint_id=str(folder / f"dcp-{step}"))
                done[0] = future.result

        return save, finish
    if method == "fabric.save":
        import lightning as L

        fabric = L.Fabric(accelerator="cpu", devices=1)
        wrapped, wrapped_opt = fabric.setup(model, optimizer)
        return (
            lambda step: fabric.save(
                folder / f"fabric-{step}.ckpt", {"model": wrapped, "optimizer": wrapped_opt}
            ),
            finish,
        )
    if method == "accelerate.save_state":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        accelerator.prepare(model, optimizer)
        return lambda step: accelerator.save_state(str(folder / f"accelerate-{step}")), finish
    import multigpu as mg

    if method.startswith("multigpu sharded"):
        from multigpu.checkpoint import sharded
        from multigpu.checkpoint.background import Stager

        stager = Stager()

        def save(step: int) -> None:
            extra = {"trainer": {"step": step}}
            if method.endswith("async"):
                pending = sharded.start_save(
                    folder / "sharded",
                    step,
                    model,
                    optimizer,
                    extra,
                    is_main=True,
                    barrier=lambda: None,
                    meta={},
                    stager=stager,
                    group=None,
                    after=lambda: None,
                )
                done[0] = lambda: _raise(pending.join())
            else:
                sharded.save(
                    folder / "sharded",
                    step,
                    model,
                    optimizer,
                    extra,
                    is_main=True,
                    barrier=lambda: None,
                )

        return save, finish
    run = mg.init(env={})
    wrapped, wrapped_opt = run.setup(model, optimizer)

    def save(step: int) -> None:
        run.save_checkpoint(
            folder / "ours",
            step,
            {"model": wrapped, "optimizer": wrapped_opt},
            keep_last=2,
            asynchronous=method.endswith("async"),
        )
        done[0] = run.wait_for_checkpoint

    return save, finish


def _raise(error) -> None:
    if error is not None:
        raise error


# ----------------------------------------------------------------------------------------- side by side


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--steps", type=int, default=8, help="training steps after each save (see 'lost')"
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpt-bench-"))
        try:
            print(json.dumps(measure(args.one, int(args.params), args.steps, folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    methods = [m for m in args.methods.split(",") if m]
    results: dict[str, list[dict]] = {m: [] for m in methods}
    for index in range(args.repeats):
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        for method in order:
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    method,
                    "--params",
                    str(args.params),
                    "--steps",
                    str(args.steps),
                    *(["--dir", args.dir] if args.dir else []),
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            if proc.returncode != 0:
                print(f"{method}: failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
                continue
            results[method].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"repeat {index + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    print_table(results, args)


def print_table(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    import torch

    size_mib = 3 * 4 * 8 * int(math.sqrt(args.params / 8)) ** 2 / 2**20
    base = [r["save_s"] for r in results.get("torch.save+fsync", [])]
    base_s = statistics.median(base) if base else float("nan")
    dcp = [r["save_s"] for r in results.get("dcp.save", [])]
    dcp_s = statistics.median(dcp) if dcp else float("nan")
    versions = [f"torch {torch.__version__}"]
    for name in ("lightning", "accelerate", "multigpu"):
        try:
            versions.append(f"{name} {__import__(name).__version__}")
        except Exception:
            pass
    print(
        f"\nstate {size_mib:.0f} MiB (model + AdamW), median of {args.repeats} fresh processes each, "
        f"{args.steps} training steps after each save; {', '.join(versions)}"
    )
    print(
        "| method | save s | stall s | lost s | extra MiB | save / torch.save+fsync | save / dcp.save |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for method, rows in results.items():
        if not rows:
            continue
        med = {
            k: statistics.median(r[k] for r in rows)
            for k in ("save_s", "stall_s", "lost_s", "extra_mib")
        }
        print(
            f"| {method} | {med['save_s']:.3f} | {med['stall_s']:.3f} | {med['lost_s']:.3f} | "
            f"{med['extra_mib']:.0f} | {med['save_s'] / base_s:.2f} | {med['save_s'] / dcp_s:.2f} |"
        )


if __name__ == "__main__":
    main()
