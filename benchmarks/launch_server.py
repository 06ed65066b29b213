"""The test suite's launch server (``LaunchServer`` in tests/conftest.py) against a new interpreter per
launch: the CPU time of one launch, as the tests pay it.

    python benchmarks/launch_server.py [--repeats 5]

Two commands the tests run: the 2-process all-reduce launch (tests/scripts/allreduce.py) and a 2-epoch run of
the digits recipe on 2 processes (its data split kept in one folder, as the tests keep it). Each is run
through the launch server (forked from one interpreter that imported torch, torch._dynamo and matplotlib's
figure) and as ``python -m multigpu ...`` in a new interpreter, alternately. The CPU time of a launch is user
plus system time of its whole process tree: for a new interpreter, what this process's waited-for children
used (``RUSAGE_CHILDREN``); for the server, what its waited-for children used (``cutime`` and ``cstime`` of
``/proc/PID/stat``). Medians and ratios are printed and recorded.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import LaunchServer, child_env  # noqa: E402  (the tests' own server, as they use it)

TICK = os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with tempfile.TemporaryDirectory(prefix="launch-server-") as tmp:
        commands = {
            "allreduce": ["run", "--nproc", "2", str(ROOT / "tests" / "scripts" / "allreduce.py")],
            "digits": ["run", "--nproc", "2", str(ROOT / "examples" / "digits" / "train.py"),
                       str(ROOT / "examples" / "digits" / "hparams.yaml"), "trainer.epochs=2",
                       f"trainer.out_dir={tmp}/out", f"data.folder={tmp}/data"],
        }
        server = LaunchServer()
        try:
            cpu: dict[tuple[str, str], list[float]] = {(c, w): [] for c in commands for w in ("server", "new")}
            wall: dict[tuple[str, str], list[float]] = {key: [] for key in cpu}
            for argv in commands.values():  # once each way first: the data split, the page cache
                _server_launch(server, argv)
                _new_launch(argv)
            for index in range(args.repeats):
                for name, argv in commands.items():
                    for way in (("server", "new") if index % 2 == 0 else ("new", "server")):
                        started = time.perf_counter()
                        used = _server_launch(server, argv) if way == "server" else _new_launch(argv)
                        wall[name, way].append(time.perf_counter() - started)
                        cpu[name, way].append(used)
        finally:
            server.close()
    figures: dict = {"repeats": args.repeats}
    for (name, way), values in cpu.items():
        figures[f"{name}_{way}_cpu_s"] = statistics.median(values)
        figures[f"{name}_{way}_cpu_min_s"] = min(values)
        figures[f"{name}_{way}_cpu_max_s"] = max(values)
        figures[f"{name}_{way}_wall_s"] = statistics.median(wall[name, way])
        print(f"{name:9s} {way:6s} CPU median {statistics.median(values):.2f} s (min {min(values):.2f}, "
              f"max {max(values):.2f}), wall median {statistics.median(wall[name, way]):.2f} s")
    for name in commands:
        figures[f"{name}_cpu_ratio"] = figures[f"{name}_server_cpu_s"] / figures[f"{name}_new_cpu_s"]
        print(f"{name}: server/new CPU {figures[f'{name}_cpu_ratio']:.3f}")
    record("launch_server", figures, [__file__, ROOT / "tests" / "conftest.py",
                                      ROOT / "tests" / "scripts" / "case_server.py",
                                      ROOT / "tests" / "scripts" / "allreduce.py"])


def _server_launch(server: LaunchServer, argv: list[str]) -> float:
    before = _waited_cpu(server.proc.pid)
    done = server.run(tuple(argv), child_env(), ROOT, timeout=300)
    if done is None or done.returncode != 0:
        raise SystemExit(f"the launch through the server failed: {done.stderr[-2000:] if done else 'server busy'}")
    return _waited_cpu(server.proc.pid) - before


def _new_launch(argv: list[str]) -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = usage.ru_utime + usage.ru_stime
    subprocess.run([sys.executable, "-m", "multigpu", *argv], check=True, capture_output=True, env=child_env(),
                   cwd=ROOT, timeout=300)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime - before


def _waited_cpu(pid: int) -> float:
    """User and system CPU seconds of the children ``pid`` has waited for (with their own waited-for ones)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / TICK  # cutime, cstime (fields 16 and 17 of stat)


if __name__ == "__main__":
    main()
