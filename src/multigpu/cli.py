"""The ``multigpu`` command: one parser with a sub-command per job; ``multigpu.commands`` holds them.

Every :class:`MultiGPUError` - and every flag argparse refuses, and every file the system refuses to
open - becomes one line on stderr with a HINT and exit status 2 (bad input, nothing was started); a
failed run returns the failing worker's status. Commands import what they use when they run, so
``multigpu slurm status`` or a mistyped flag answers without loading torch.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import sys
import threading
from typing import Any, NoReturn, Optional, Sequence

from typing_extensions import override

from multigpu.commands.checkpoint import add_checkpoint_parser
from multigpu.commands.diagnostics import (
    add_check_parser,
    add_doctor_parser,
    add_env_parser,
    add_plot_parser,
)
from multigpu.commands.launching import add_run_parser
from multigpu.commands.queue import add_queue_parser
from multigpu.commands.slurm import SLURM_ACTIONS, add_slurm_parser
from multigpu.errors import EXIT_INTERRUPTED, EXIT_REFUSED, MultiGPUError, visible
from multigpu.launch.process import Stopped, mark_command_process


class Parser(argparse.ArgumentParser):
    """argparse, but a refused flag is our one line with a HINT (argparse prints usage and a second line),
    and no abbreviations: ``--tee 3`` must not be read as ``--tee-prefix 3``, nor a typo as another flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    @override
    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        where = self.prog.removeprefix("multigpu").strip()
        print(
            f"multigpu: error: {f'{where}: ' if where else ''}{visible(message)}. HINT: {peer_hint(message)}"
            f"see `{self.prog} --help`.",
            file=sys.stderr,
        )
        sys.exit(2)


#: Flags and commands of the launchers people come from (Accelerate's `accelerate launch`, Lightning's
#: Trainer flags, torchrun's old launch module), and what says the same here.
PEER_FLAGS = {
    "--num_processes": "multigpu run --nproc N",
    "--num-processes": "multigpu run --nproc N",
    "--num_machines": "multigpu run --nnodes N",
    "--machine_rank": "multigpu run --node-rank R",
    "--main_process_ip": "multigpu run --master-addr HOST",
    "--main_process_port": "multigpu run --master-port PORT",
    "--gpu_ids": "multigpu run --gpus 0,1",
    "--multi_gpu": "multigpu run (every visible GPU is the default)",
    "--mixed_precision": "the script's own precision setting (a Trainer's: trainer.precision=bf16, after the script)",
    "--config_file": "multigpu run's flags, and the recipe's YAML file after the script (multigpu run train.py hparams.yaml)",
    "--devices": "multigpu run --nproc N or --gpus 0,1",
    "--accelerator": "multigpu run --cpu (GPUs are the default)",
    "--use_env": "nothing: the workers always get their rank in the environment, as torchrun's",
    "launch": "multigpu run",
    "accelerate": "multigpu run",
}


def peer_hint(message: str) -> str:
    """'use X for Y; ' for each flag or command of another launcher the message names ('' for none)."""
    named = [word.strip("'\",()") for word in message.split()]
    found = [
        f"{word} is {PEER_FLAGS[word]} here; "
        for word in dict.fromkeys(named)
        if word in PEER_FLAGS
    ]
    return "".join(found[:3])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="multigpu",
        description="Run one PyTorch training script on every GPU, several machines, Slurm, or a GPU pool.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_run_parser(sub)
    add_slurm_parser(sub)
    add_queue_parser(sub)
    add_checkpoint_parser(sub)
    add_check_parser(sub)
    add_doctor_parser(sub)
    add_env_parser(sub)
    add_plot_parser(sub)
    return parser


def _version() -> str:
    from multigpu import __version__

    return f"multigpu {__version__}"


def _with_default_actions(argv: list[str]) -> list[str]:
    """``multigpu slurm train.py`` means ``multigpu slurm submit train.py`` (the short form users type)."""
    if len(argv) >= 2 and argv[0] == "slurm" and argv[1] not in (*SLURM_ACTIONS, "-h", "--help"):
        return ["slurm", "submit", *argv[1:]]
    return argv


def _os_error_line(exc: OSError) -> str:
    what = exc.strerror or type(exc).__name__
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    return (
        f"multigpu: error: {what}{': ' + ' -> '.join(names) if names else ''}. "
        "HINT: check the path, that its folder exists, free disk space and permissions."
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = _with_default_actions(list(sys.argv[1:] if argv is None else argv))
    try:
        # inside: a flag's own check (a refused torchrun flag) is a refusal too
        args = build_parser().parse_args(argv)
        status: int = args.handler(args)
        return status
    except MultiGPUError as exc:
        print(exc.one_line(), file=sys.stderr)
        return EXIT_REFUSED
    # a file or folder the system refused: the user's to fix, not a bug of ours
    except OSError as exc:
        print(_os_error_line(exc), file=sys.stderr)
        return EXIT_REFUSED
    except UnicodeError as exc:  # text that cannot be written (a lone surrogate from a YAML escape)
        print(
            f"multigpu: error: {' '.join(str(exc).split())[:200]}. HINT: use plain UTF-8 text in names, paths "
            "and values.",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("multigpu: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    # a command that stops cleanly on a signal (check: its runs, its folders)
    except Stopped as stopped:
        if stopped.signum == signal.SIGINT:
            print("multigpu: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"multigpu: stopped by {signal.Signals(stopped.signum).name}", file=sys.stderr)
        return 128 + stopped.signum


def entry() -> NoReturn:
    """The ``multigpu`` command's process: :func:`main`, then leave with its status without the
    interpreter freeing every module. Why: after ``multigpu run`` has imported torch that teardown is
    0.5-1 s of CPU spent after the workers have finished (``multigpu run --nproc 2`` of a script that only
    calls ``mg.init()``: 4.9 s of CPU in all before, 4.2 s after, medians of 5 interleaved runs on 2
    cores). Files left open are closed (a garbage collection), atexit handlers run and the streams are
    flushed; while another non-daemon thread is alive Python would wait for it, and so this exits the
    ordinary way then. It also marks the process as the command's own (a launcher may freeze what it
    imports for the garbage collector: :func:`multigpu.launch.process.collector_paused`)."""
    mark_command_process()
    code = main()
    if not any(
        t is not threading.main_thread() and t.is_alive() and not t.daemon
        for t in threading.enumerate()
    ):
        try:
            gc.collect()
            atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    if stream is not None:  # None: started with that stream closed
                        stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
