"""Time lost per failure: replica groups (torchft) against today's restart from the last checkpoint.

    unshare --net sh -c 'ip link set lo up && python benchmarks/fault_tolerance.py --repeats 3'

Each repeat runs, interleaved, three fresh jobs of 2 CPU processes with the same training (steps of a
fixed 0.1 s, 300 of them, a checkpoint every 10 steps) and SIGKILLs one process in the middle of step 26:

- ``restart``: ``multigpu run --nproc 2 --max-restarts 1`` - the agent restarts both workers, which resume
  from the step-20 checkpoint and train steps 21-25 again;
- ``ft-1s`` and ``ft-5s``: ``multigpu run --replica-groups 2 --max-restarts 1`` with a heartbeat timeout of
  1 s and 5 s (torchft's default) - the other group drops step 26, waits for the heartbeat timeout, goes on
  alone; the killed group restarts and heals.

Time lost per failure = (when the job finished step 26 after the kill) - (the kill) - (one median step):
the time the job made no progress. For replica groups it is the survivor's; while the killed group is
away the survivor trains with half the global batch, which is reported too (steps at half batch, and the
killed group's time from the kill to its first step back).

Runs must be inside a network namespace with only loopback: torchft 0.2.0's manager server listens on
every interface (docs/security.md). The script refuses to run otherwise.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "fault_tolerance_worker.py")
MODES = {
    "restart": ["--nproc", "2"],
    "ft-1s": ["--replica-groups", "2", "--heartbeat-timeout", "1"],
    "ft-5s": ["--replica-groups", "2", "--heartbeat-timeout", "5"],
}
KILL_AT, STEP_S = 25, 0.1


def records(out: Path, group: int) -> list[dict]:
    path = out / f"steps-g{group}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def measure(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "multigpu",
                "run",
                *MODES[mode],
                "--max-restarts",
                "1",
                WORKER,
                str(out),
                "--kill-at",
                str(KILL_AT),
                "--step-s",
                str(STEP_S),
                "--steps",
                "300",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise SystemExit(f"{mode} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        killed = float((out / "killed").read_text())
        main = records(out, 0)
        before = [
            b["t"] - a["t"] for a, b in zip(main, main[1:]) if b["t"] < killed and b["attempt"] == 0
        ]
        step = statistics.median(before)
        beyond = next(r for r in main if r["t"] > killed and r["step"] > KILL_AT)
        result = {"mode": mode, "lost_s": beyond["t"] - killed - step, "median_step_s": step}
        if mode.startswith("ft"):
            back = [r for r in records(out, 1) if r["attempt"] == 1]
            result["half_batch_steps"] = sum(1 for r in main if r["live"] == 1)
            result["killed_group_back_s"] = back[0]["t"] - killed if back else None
            result["survivor_restarted"] = any(r["attempt"] for r in main)
        return result


def only_loopback() -> bool:
    import socket

    # this network namespace's interfaces
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write every measurement here")
    args = parser.parse_args()
    if not only_loopback():
        raise SystemExit(
            "run this inside a network namespace with only loopback: unshare --net sh -c "
            "'ip link set lo up && python benchmarks/fault_tolerance.py'"
        )
    rows = []
    for index in range(args.repeats):
        for mode in MODES:
            rows.append(measure(mode))
            print(json.dumps({"repeat": index + 1, **rows[-1]}), flush=True)
    print(
        f"\ntime lost per failure (kill in the middle of step {KILL_AT + 1}, steps of {STEP_S} s, checkpoint every "
        f"10 steps), {args.repeats} repeats, medians:"
    )
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        lost = [r["lost_s"] for r in mine]
        line = f"  {mode:8s} {statistics.median(lost):6.2f} s lost (min {min(lost):.2f}, max {max(lost):.2f})"
        if mode.startswith("ft"):
            back = [r["killed_group_back_s"] for r in mine if r["killed_group_back_s"] is not None]
            came = (
                f"back after {statistics.median(back):.2f} s" if back else "not back before the end"
            )
            line += (
                f"; {statistics.median(r['half_batch_steps'] for r in mine):.0f} steps at half batch, killed group "
                f"{came} ({len(back)} of {len(mine)}); survivor restarted: "
                f"{any(r['survivor_restarted'] for r in mine)}"
            )
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
