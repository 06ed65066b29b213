"""Checks for values that come from outside - flags, runs files, environment - before they are used.

Why one module: the same few rules (a count within sane bounds, a name that is safe as a folder, an
environment variable name that is an identifier, text without control characters) guard the launcher,
the queue and the Slurm scripts. Each check raises the caller's error type with a HINT, so a bad value
is one line at the door instead of a traceback - or a shell line, or a folder outside the output -
further in. Standard library only.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from multigpu.errors import MultiGPUError

#: No machine has more cores or GPUs than this per node; a larger count is a typo (``--nproc 100000``).
MAX_PROCS_PER_NODE = 4096
#: Processes sharing one GPU (``--procs-per-gpu``) or runs packed onto one (``--runs-per-gpu``): each
#: holds a CUDA context, so more than this only fills the GPU with contexts.
MAX_SHARERS_PER_GPU = 16
#: Slurm's own limits are far below this; it only catches typos before a script is written.
MAX_NODES = 65536
MAX_SIMULATED_NODES = 64
#: Run names become folder names (and Slurm job names): a safe, portable subset.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: What a runs file may set in a run's environment: the knobs of the libraries a training run uses.
#: Anything else - PYTHON*, LD_*, PATH, BROWSER, SLURM_*, MASTER_* ... - can make a process run other
#: code or steer the launcher (PYTHONWARNINGS imports any module; bash evaluates SLURM_JOB_ID in
#: arithmetic): allowed only when the person starting the queue names it (``--allow-env NAME``).
ENV_ALLOWED_PREFIXES = ("NCCL_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GLOO_", "CUDA_", "CUBLAS_", "CUDNN_", "NVIDIA_TF32_",
                        "TORCH_LOGS", "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_", "TORCH_SHOW_CPP_STACKTRACES",
                        "PYTORCH_CUDA_ALLOC_CONF", "HF_", "TOKENIZERS_", "TRANSFORMERS_", "DATASETS_", "WANDB_",
                        "MLFLOW_", "TF_CPP_", "MIOPEN_")
ENV_REFUSED_PARTS = ("PLUGIN", "PRELOAD", "LIBRARY", "PATH", "HOOK", "EXEC")
#: Set by the queue and the launcher for every run: never from a runs file.
ENV_RESERVED = ("CUDA_VISIBLE_DEVICES",)


def count(value: object, what: str, error: type[MultiGPUError] = MultiGPUError, low: int = 1,
          high: int = MAX_PROCS_PER_NODE, hint: Optional[str] = None) -> int:
    """``value`` as an int within ``low..high`` (booleans and non-integers are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{what} {value!r} is not a whole number.", hint or f"use a number from {low} to {high}.")
    if value < low:
        raise error(f"{what} {value} must be at least {low}.", hint or f"use {low} or more.")
    if value > high:
        raise error(f"{what} {value} is more than {high:,}.",
                    hint or f"use at most {high:,}; no machine runs more per node (a typo?). "
                    "If you really need more, please open an issue.")
    return value


def positive_seconds(value: object, what: str, error: type[MultiGPUError] = MultiGPUError,
                     high: float = 7 * 24 * 3600) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= high:
        raise error(f"{what} {value!r} must be a positive number of seconds (at most {high:g}).",
                    f"e.g. {what} 120.")
    return float(value)


def run_name(name: object, error: type[MultiGPUError] = MultiGPUError, where: str = "") -> str:
    """A run name that is safe as one folder name: letters, digits, ``._-``, no leading dot, <= 100."""
    if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise error(f"{where}run name {shown} is not allowed: it becomes a folder name.",
                    "use letters, digits and . _ - (not first: . or -), at most 100 characters.")
    return name


def env_name(name: object, error: type[MultiGPUError] = MultiGPUError, where: str = "") -> str:
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise error(f"{where}environment variable name {shown} is not an identifier.",
                    "use letters, digits and _ (not starting with a digit).")
    return name


def env_allowed(name: str, allowed: Sequence[str] = (), error: type[MultiGPUError] = MultiGPUError,
                where: str = "") -> str:
    """A runs file's variable: a known library knob, or named by ``--allow-env`` (never a reserved one)."""
    if name in ENV_RESERVED:
        raise error(f"{where}environment variable {name} is set by the queue for every run.",
                    "remove it: the queue chooses each run's GPUs.")
    if name in allowed:
        return name
    if name.startswith(ENV_ALLOWED_PREFIXES) and not any(part in name for part in ENV_REFUSED_PARTS):
        return name
    raise error(f"{where}environment variable {name} may change which code a run loads or how it is launched; a "
                "runs file may not set it on its own.",
                f"if you trust this runs file, allow it: `multigpu queue ... --allow-env {name}` (or set it in your "
                "own shell before starting the queue).")


def plain_text(value: object, what: str, error: type[MultiGPUError] = MultiGPUError, allow_space: bool = True,
               pattern: Optional[str] = None, example: str = "") -> str:
    """Text with no control characters (newlines end #SBATCH blocks and shell lines), optionally matched;
    always encodable as UTF-8 (a lone surrogate from a YAML escape cannot be written to a file)."""
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{what} {text[:40]!r} is not valid Unicode text.", "remove the \\uD800-style escape.") from None
    if _CONTROL.search(text) or (not allow_space and re.search(r"\s", text)):
        raise error(f"{what} {text[:60]!r} contains {'whitespace or ' if not allow_space else ''}control characters.",
                    f"give a single plain value{f', e.g. {example}' if example else ''}.")
    if pattern is not None and not re.fullmatch(pattern, text):
        raise error(f"{what} {text[:60]!r} is not a valid value.", f"e.g. {example}." if example else "check it.")
    return text
