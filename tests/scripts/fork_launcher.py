"""A launcher as the fork server sees one: a new interpreter that starts a :class:`ForkServer` and starts boot
processes as its own children (the server forks only for its launcher's children). test_forkserver.py's
server tests drive it, one JSON command per line on stdin, one JSON answer per line on stdout.

Why not start the server from the pytest process: a server forked from there, and every worker forked from
that server, would carry pytest's heap, its exit handlers and the state of execnet's reader thread (a thread
``threading`` does not list) - none of which a user's launcher (``multigpu run``) has. A worker that waits at
its exit on something of pytest's is a failure of the test, not of the product.

    python fork_launcher.py LOG       # then: {"do": "run", "argv": [...], "env": {...}, "timeout": 120}
                                      #       {"do": "run", ..., "signal": 15, "wait": 30}  (after the first line)
                                      #       {"do": "running"}   {"do": "stop"}
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from multigpu.launch.boot import FORKSERVER_VAR
from multigpu.launch.forkserver import ForkServer


def where(pid: str) -> str:
    """A process's state, the kernel function it waits in, and its signal masks."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return "gone"
    fields = [line for line in status.splitlines() if line.startswith(("State", "Threads", "Sig", "Shd"))]
    return f"{' '.join(fields)} wchan={wchan}"


def run(command: dict, server: ForkServer) -> dict:
    """Start ``argv`` as our child, to completion (``timeout``, default 120 s: then killed, status None); with
    ``signal``: send it that signal after its first line of output, and wait ``wait`` seconds for it to end
    (where it does not, say where it and its worker are, with the worker's Python stack)."""
    proc = subprocess.Popen(command["argv"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=command["env"])
    answer: dict = {}
    timeout = command.get("timeout", 120)
    if command.get("signal"):
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], timeout)[0]:  # no first line: leave it to communicate's end
            return _killed(proc, answer, f"no first line in {timeout} s")
        answer["first"] = first = proc.stdout.readline()
        proc.send_signal(command["signal"])
        try:
            proc.wait(timeout=command["wait"])
        except subprocess.TimeoutExpired:
            worker = first.split()[-1] if first.split() else ""
            answer["hung"] = {pid: where(pid) for pid in (str(proc.pid), worker, str(server.pid)) if pid}
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(worker), signal.SIGUSR2)  # a script with faulthandler.register prints its stack
            time.sleep(1)
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(worker), signal.SIGKILL)
            return _killed(proc, answer, f"not ended {command['wait']} s after the signal")
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return _killed(proc, answer, f"not ended in {timeout} s")
    answer.update(status=proc.returncode, stdout=(answer.get("first", "") + out), stderr=err)
    return answer


def _killed(proc: subprocess.Popen, answer: dict, why: str) -> dict:
    """Kill ``proc``; its output so far, status None and why."""
    proc.kill()
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process it started still holds its pipes
        out, err = "", ""
    answer.update(status=None, stdout=answer.get("first", "") + out, stderr=f"{err}\n[fork_launcher: {why}]")
    return answer


def main(log: str) -> int:
    with open(log, "wb") as handle:
        servers: list[ForkServer] = []
        ForkServer.start(servers.append, verbose=True, stderr=handle.fileno())
    if not servers:
        print(json.dumps({"error": "no fork server"}), flush=True)
        return 1
    server = servers[0]
    print(json.dumps({"pid": server.pid, "path": server.path, "folder": server.folder,
                      "env": {**os.environ, FORKSERVER_VAR: server.path}}), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["do"] == "run":
                answer = run(command, server)
            elif command["do"] == "running":
                answer = {"running": server.running()}
            else:
                break
            print(json.dumps(answer), flush=True)
    finally:
        server.stop()
    print(json.dumps({"stopped": not Path(server.folder).exists()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
