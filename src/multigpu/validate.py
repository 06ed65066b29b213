"""Checks for values that come from outside - flags, runs files, environment - before they are used.

Why one module: the same few rules (a count within sane bounds, a name that is safe as a folder, an
environment variable name that is an identifier, text without control characters) guard the launcher,
the queue and the Slurm scripts. Each check raises the caller's error type with a HINT, so a bad value
is one line at the door instead of a traceback - or a shell line, or a folder outside the output -
further in. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from multigpu.errors import MultiGPUError, shown

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
#: The one environment door: the variables a runs file may set on its own, each exactly by name, with
#: why it is harmless - it tunes a library and names no file, folder, URL, host, credential, library or
#: plugin. Anything else (PYTHONWARNINGS imports any module; LD_PRELOAD loads any library; SLURM_* and
#: MASTER_* steer the launcher; WANDB_BASE_URL, MLFLOW_TRACKING_URI or HF_ENDPOINT send your credentials
#: to a server the file chose; TORCH_LOGS_OUT or MKL_VERBOSE_OUTPUT_FILE write files anywhere) needs
#: ``--allow-env NAME`` from the person starting the queue.
@dataclass(frozen=True)
class EnvValue:
    """What an allow-listed variable's value may be: why the name is harmless, and its type - a whole number
    in bounds, one of a few words (any case), or text matching a pattern. A value the library would choke on
    (``PYTHONHASHSEED=x`` is a fatal error of every interpreter, ``TORCH_DISTRIBUTED_DEBUG=bogus`` a
    traceback of every rank) is one line at the door instead."""

    why: str
    low: Optional[int] = None  # a whole number from low to high
    high: Optional[int] = None
    words: tuple[str, ...] = ()  # or one of these (case does not matter)
    pattern: Optional[str] = None  # or text matching this (else: plain text of at most 200 characters)

    def problem(self, value: str) -> Optional[str]:
        """Why ``value`` is not one of these (None: it is)."""
        if self.words and value.lower() in self.words:
            return None
        if self.low is not None and self.high is not None and is_digits(value):
            return None if self.low <= int(value) <= self.high else f"is outside {self.low}..{self.high}"
        if self.pattern is not None and re.fullmatch(self.pattern, value):
            return None
        if not self.words and self.low is None and self.pattern is None:
            return None if len(value) <= 200 and not _CONTROL.search(value) else "is not short plain text"
        want = [f"a whole number from {self.low} to {self.high}"] if self.low is not None else []
        want += [f"one of {', '.join(self.words[:8])}"] if self.words else []
        want += [f"text like {self.pattern[:40]}"] if self.pattern else []
        return "is not " + " or ".join(want)


_THREADS = EnvValue("CPU threads", 1, 4096)
_ON_OFF = ("0", "1")
_BOOL_WORDS = ("0", "1", "true", "false", "yes", "no", "on", "off")
_NAMES = r"[\^=]?[\w.:-]{1,64}(,[\^=]?[\w.:-]{1,64}){0,31}"  # NCCL's interface/HCA lists: ^eth,=ib0:1
_WORDS = r"[\w.^-]{1,64}(,[\w.^-]{1,64}){0,63}"  # comma-separated words (NCCL_ALGO, NCCL_DEBUG_SUBSYS)
_COLLECTIVES = "collective communication tuning (interface names, not hosts)"
_TORCH = "PyTorch diagnostics and tuning (to stderr)"
_HF = "Hugging Face: offline and verbosity"
_LOGGERS = "logger naming and modes (the server and the credentials stay yours)"
_VERBOSITY = ("debug", "info", "warning", "error", "critical")
#: The one environment door: the variables a runs file may set on its own, each exactly by name, with
#: why it is harmless - it tunes a library and names no file, folder, URL, host, credential, library or
#: plugin - and what its value may be. Anything else (PYTHONWARNINGS imports any module; LD_PRELOAD loads
#: any library; SLURM_* and MASTER_* steer the launcher; WANDB_BASE_URL, MLFLOW_TRACKING_URI or HF_ENDPOINT
#: send your credentials to a server the file chose; TORCH_LOGS_OUT or MKL_VERBOSE_OUTPUT_FILE write files
#: anywhere) needs ``--allow-env NAME`` from the person starting the queue.
ENV_VALUES: dict[str, EnvValue] = {
    **dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"), _THREADS),
    "KMP_AFFINITY": EnvValue("CPU threads", pattern=r"[\w,=.\[\]-]{1,200}"),
    "KMP_BLOCKTIME": EnvValue("CPU threads", 0, 10**7, words=("infinite",)),
    "TOKENIZERS_PARALLELISM": EnvValue("CPU threads", words=_BOOL_WORDS),
    "NCCL_DEBUG": EnvValue(_COLLECTIVES, words=("version", "warn", "info", "abort", "trace")),
    "NCCL_DEBUG_SUBSYS": EnvValue(_COLLECTIVES, pattern=_WORDS),
    **dict.fromkeys(("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA"),
                    EnvValue(_COLLECTIVES, pattern=_NAMES)),
    **dict.fromkeys(("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"),
                    EnvValue(_COLLECTIVES, words=_ON_OFF)),
    "NCCL_CROSS_NIC": EnvValue(_COLLECTIVES, 0, 2),
    "NCCL_IB_TIMEOUT": EnvValue(_COLLECTIVES, 1, 31),
    **dict.fromkeys(("NCCL_P2P_LEVEL", "NCCL_NET_GDR_LEVEL"),
                    EnvValue(_COLLECTIVES, 0, 10, words=("loc", "nvl", "pix", "pxb", "phb", "sys"))),
    **dict.fromkeys(("NCCL_ALGO", "NCCL_PROTO"), EnvValue(_COLLECTIVES, pattern=_WORDS)),
    "NCCL_NTHREADS": EnvValue(_COLLECTIVES, 1, 1024),
    "NCCL_BUFFSIZE": EnvValue(_COLLECTIVES, 1, 2**40),
    **dict.fromkeys(("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"), EnvValue(_COLLECTIVES, 1, 1024)),
    **dict.fromkeys(("CUDA_LAUNCH_BLOCKING", "NVIDIA_TF32_OVERRIDE"), EnvValue("GPU behaviour", words=_ON_OFF)),
    "CUDA_DEVICE_MAX_CONNECTIONS": EnvValue("GPU behaviour", 1, 32),
    "CUDA_MODULE_LOADING": EnvValue("GPU behaviour", words=("lazy", "eager")),
    "CUBLAS_WORKSPACE_CONFIG": EnvValue("GPU behaviour", pattern=r":[0-9]{1,9}:[0-9]{1,9}(,:[0-9]{1,9}:[0-9]{1,9}){0,7}"),
    "PYTORCH_CUDA_ALLOC_CONF": EnvValue("GPU behaviour", pattern=r"[\w.]{1,64}:[\w.]{1,64}(,[\w.]{1,64}:[\w.]{1,64}){0,15}"),
    "TORCH_DISTRIBUTED_DEBUG": EnvValue(_TORCH, words=("off", "info", "detail")),
    "TORCH_SHOW_CPP_STACKTRACES": EnvValue(_TORCH, words=_ON_OFF),
    "TORCH_CPP_LOG_LEVEL": EnvValue(_TORCH, 0, 3, words=("info", "warning", "error", "fatal")),
    # the names torch knows are checked by torch's own parser, in the run's launcher (launch.local)
    "TORCH_LOGS": EnvValue(_TORCH, pattern=r"[+-]?[\w.]{1,64}(,[+-]?[\w.]{1,64}){0,63}"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": EnvValue(_TORCH, 0, 3),
    **dict.fromkeys(("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING",
                     "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_FREEZING"), EnvValue(_TORCH, words=_ON_OFF)),
    **dict.fromkeys(("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), EnvValue(_TORCH, 0, 10**7)),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": EnvValue(_TORCH, 1, 10**6),
    **dict.fromkeys(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"),
                    EnvValue(_HF, words=_BOOL_WORDS)),
    **dict.fromkeys(("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY"), EnvValue(_HF, words=_VERBOSITY)),
    "WANDB_MODE": EnvValue(_LOGGERS, words=("online", "offline", "disabled", "dryrun", "run", "shared")),
    **dict.fromkeys(("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NOTES", "MLFLOW_EXPERIMENT_NAME"),
                    EnvValue(_LOGGERS)),
    **dict.fromkeys(("WANDB_SILENT", "WANDB_DISABLE_CODE"), EnvValue(_LOGGERS, words=_BOOL_WORDS)),
    "WANDB_CONSOLE": EnvValue(_LOGGERS, words=("auto", "off", "wrap", "redirect", "wrap_raw", "wrap_emu")),
    "PYTHONHASHSEED": EnvValue("Python hashing and output", 0, 4294967295, words=("random",)),
    **dict.fromkeys(("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER"), EnvValue("Python hashing and output", pattern=r"[\w]{1,16}")),
}
#: Why each allow-listed name is harmless (the table above, by name).
ENV_ALLOWED = {name: rule.why for name, rule in ENV_VALUES.items()}
#: Values that reach the launcher from its own environment and would end every rank before its first line:
#: checked by ``multigpu run`` itself (:func:`launch_environment`).
#: (PYTHONHASHSEED's own interpreter dies before any line of ours runs: a runs file's is checked by the queue.)
CHECKED_AT_LAUNCH = ("TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS")
#: Parts of a name that say it points somewhere or grants something: never allowed by the table above.
ENV_POINTING_PARTS = ("URL", "URI", "ENDPOINT", "HOST", "ADDR", "SERVER", "TOKEN", "KEY", "SECRET", "PASSWORD",
                      "PASSWD", "CREDENTIAL", "AUTH", "FILE", "DIR", "PATH", "HOME", "CACHE", "LIBRARY", "PLUGIN",
                      "PRELOAD", "HOOK", "EXEC", "CONFIG")
#: Names that say where a process sends data: when a runs file sets one, credentials stay out of that run.
ENV_ENDPOINT_PARTS = ("URL", "URI", "ENDPOINT", "HOST", "ADDR", "SERVER", "PROXY")
#: Credentials a process inherits from your shell: never passed to a run whose endpoints came from a file.
ENV_CREDENTIAL_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "NETRC")
#: Set by the queue and the launcher for every run: never from a runs file.
ENV_RESERVED = ("CUDA_VISIBLE_DEVICES",)


#: A whole number as a person or a launcher writes one: ASCII digits and an optional sign. Python's
#: int() takes more - "١٢" (Arabic-Indic digits), "1_000", " 7 " - and none of that is a number here.
_WHOLE = re.compile(r"[-+]?[0-9]{1,100}")


def is_digits(text: object) -> bool:
    """``text`` is ASCII digits only (no sign): what str.isdigit() means to a reader, not "²" or "١".
    At most 100 of them, as in a whole number: callers convert with int(), which refuses more than 4300
    digits with a ValueError (a traceback where a Slurm job id or a log file name held them)."""
    return isinstance(text, str) and re.fullmatch(r"[0-9]{1,100}", text) is not None


def whole_number(text: object, what: str, error: type[MultiGPUError] = MultiGPUError, hint: str = "") -> int:
    """``text`` (a flag, a YAML value, an environment variable) as an int: ASCII digits and a sign only."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        raise error(f"{what}={shown(text, 60)} is not an integer.",
                    hint or f"write {what} with the digits 0-9 only (no underscores or other scripts' digits).")
    return int(text)


def whole_flag(text: str) -> int:
    """argparse's ``type=`` for whole-number flags, in place of ``int`` (which takes "١٢" and "1_000")."""
    if not _WHOLE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{shown(text, 60)} is not a whole number (write it with the digits 0-9)")
    return int(text)


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


def env_value(name: str, value: object, error: type[MultiGPUError] = MultiGPUError, where: str = "") -> str:
    """``value`` of the variable ``name``, checked by its rule (:data:`ENV_VALUES`; a name without one:
    plain text) - also for a name ``--allow-env`` admitted: the value would end the run all the same."""
    text = str(value)
    rule = ENV_VALUES.get(name, EnvValue(""))
    problem = rule.problem(text)
    if problem is not None:
        example = rule.words[0] if rule.words else (str(rule.low) if rule.low is not None else "a short value")
        raise error(f"{where}environment variable {name}={shown(text, 60)} {problem}.",
                    f"give {name} a value its library takes (e.g. {example}), or remove it.")
    return text


def launch_environment(environ: Mapping[str, str], error: type[MultiGPUError] = MultiGPUError) -> None:
    """The launcher's own environment, before it starts anything: the values of :data:`CHECKED_AT_LAUNCH`
    that every rank would die of."""
    for name in CHECKED_AT_LAUNCH:
        if environ.get(name):
            env_value(name, environ[name], error)


def env_allowed(name: str, allowed: Sequence[str] = (), error: type[MultiGPUError] = MultiGPUError,
                where: str = "") -> str:
    """A runs file's variable: one of :data:`ENV_ALLOWED`, or named by ``--allow-env`` (never a reserved one)."""
    if name in ENV_RESERVED:
        raise error(f"{where}environment variable {name} is set by the queue for every run.",
                    "remove it: the queue chooses each run's GPUs.")
    if name in allowed or name in ENV_ALLOWED:
        return name
    pointing = [part for part in ENV_POINTING_PARTS if part in name]
    why = (f"names a {pointing[0].lower()}" if pointing else "is not one of the library settings a runs file may set")
    raise error(f"{where}environment variable {name} {why}; a runs file may not set it on its own.",
                f"if you trust this runs file, allow it: `multigpu queue ... --allow-env {name}` (or set it in your own "
                "shell before starting the queue).")


def run_environment(inherited: Mapping[str, str], from_file: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The environment of a run started from a runs file, and the names of credentials held back.

    When the file sets where a run sends data (a URL, URI, endpoint, host - allowed by ``--allow-env``),
    the credentials of your shell (tokens, keys, passwords) are not passed on, unless the file sets
    them itself - which also needs ``--allow-env``: a file chooses a server *and* your key only when you
    said both names."""
    env = dict(inherited)
    held: list[str] = []
    if any(part in name for name in from_file for part in ENV_ENDPOINT_PARTS):
        held = sorted(name for name in env if any(part in name.upper() for part in ENV_CREDENTIAL_PARTS)
                      and name not in from_file)
        for name in held:
            del env[name]
    env.update(from_file)
    return env, held


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


# ---------------------------------------------------------------------------- the settings door
#: Text settings longer than this are refused (a path, a name, a metric); lists longer than MAX_ITEMS too.
MAX_TEXT = 4096
MAX_ITEMS = 10_000


@dataclass(frozen=True)
class Rule:
    """What one setting may be: its type, bounds or choices, and whether None is allowed."""

    kind: type
    low: Optional[float] = None
    high: Optional[float] = None
    choices: Optional[tuple[Any, ...]] = None
    optional: bool = False
    #: The lowest value is excluded (a positive number of seconds).
    positive: bool = False
    #: Text may be empty or only spaces (False for a path: ``--resume ""`` must not silently not resume).
    blank: bool = True

    def describe(self) -> str:
        if self.choices is not None:
            wanted = " or ".join(repr(c) for c in self.choices)
        elif self.kind is bool:
            wanted = "true or false"
        elif self.kind in (int, float):
            noun = "a whole number" if self.kind is int else "a number"
            lo = "" if self.low is None else f"{'above' if self.positive else 'from'} {_number(self.low)}"
            hi = "" if self.high is None else f"{'up ' if not lo else ''}to {_number(self.high)}"
            wanted = f"{noun} {lo} {hi}".strip()
        elif self.kind is str:
            wanted = f"{'' if self.blank else 'non-blank '}text of at most {MAX_TEXT} characters"
        else:
            wanted = f"a {self.kind.__name__}"
        return f"{wanted}{', or null' if self.optional else ''}"


def setting(default: Any = dataclasses.MISSING, **rule: Any) -> Any:
    """A dataclass field with its bounds declared beside it, ``epochs: int = setting(1, low=0, high=10**9)``
    (``low``, ``high``, ``choices``, ``positive``, ``blank`` as :class:`Rule` has them); its type and whether
    None is allowed are the annotation's (:func:`rules_of`)."""
    return dataclasses.field(default=default, metadata={"rule": rule})


def rules_of(cls: type) -> dict[str, Rule]:
    """Each field's :class:`Rule`: the annotation's type (``Optional``: None allowed) and the bounds its
    :func:`setting` declares. Fields of other types (``Any``, mappings, functions) have no rule here: their
    own checks read them."""
    hints = typing.get_type_hints(cls)
    rules = {}
    for item in dataclasses.fields(cls):
        kind, optional = _kind(hints[item.name])
        if kind is not None:
            rules[item.name] = Rule(kind, optional=optional, **item.metadata.get("rule", {}))
        elif "rule" in item.metadata:
            raise TypeError(f"{cls.__name__}.{item.name}: bounds on a field of type {hints[item.name]}")
    return rules


def _kind(annotation: Any) -> tuple[Optional[type], bool]:
    """``Optional[int]`` -> (int, True); ``list[Any]`` -> (list, False); anything else -> (None, False)."""
    optional = False
    if typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(rest) < len(typing.get_args(annotation))
        if len(rest) != 1:
            return None, False
        annotation = rest[0]
    origin = typing.get_origin(annotation) or annotation
    return (origin, optional) if origin in (bool, int, float, str, list) else (None, False)


def checked(owner: str, name: str, value: Any, rule: Rule, error: type[MultiGPUError] = MultiGPUError) -> Any:
    """``value`` if it follows ``rule``; otherwise one line naming the setting and what it may be."""
    if value is None and rule.optional:
        return value
    ok = True
    if rule.kind is bool or isinstance(value, bool):
        ok = isinstance(value, bool) and rule.kind is bool
    elif rule.kind is float:
        ok = isinstance(value, (int, float)) and math.isfinite(value)
    elif rule.kind is str:
        ok = isinstance(value, str) and len(value) <= MAX_TEXT and not _CONTROL.search(value) and _utf8(value)
        ok = ok and (rule.blank or bool(value.strip()))
    elif rule.kind is list:
        ok = isinstance(value, (list, tuple)) and len(value) <= MAX_ITEMS
    else:
        ok = isinstance(value, rule.kind)
    if ok and rule.choices is not None:
        ok = value in rule.choices
    if ok and rule.kind in (int, float):
        ok = ((rule.low is None or (value > rule.low if rule.positive else value >= rule.low))
              and (rule.high is None or value <= rule.high))
    if not ok:
        raise error(f"{owner} setting {name}={shown(value)} is invalid.", f"use {rule.describe()}.")
    return value


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: torch.compile's own arguments, and the inductor options (all on/off switches) a settings file may
#: set. Anything else - above all a free string such as ``cpp.march`` or ``cpp.cxx``, which reach the C++
#: compiler's command line (``-wrapper /bin/sh`` runs a program), or ``trace.debug_dir`` (a folder
#: written to) - is refused: a settings file is data, and data must not choose what a compiler runs.
COMPILE_ARGUMENTS = {
    "fullgraph": Rule(bool), "dynamic": Rule(bool, optional=True),
    "backend": Rule(str, choices=("inductor", "eager", "aot_eager", "cudagraphs")),
    "mode": Rule(str, optional=True, choices=("default", "reduce-overhead", "max-autotune",
                                              "max-autotune-no-cudagraphs")),
}
COMPILE_OPTIONS = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise", "epilogue_fusion",
                   "coordinate_descent_tuning", "shape_padding", "freezing", "aggressive_fusion",
                   "triton.cudagraphs", "triton.cudagraph_trees", "benchmark_kernel", "layout_optimization",
                   "memory_planning", "split_reductions")


def compile_settings(value: Any, error: type[MultiGPUError] = MultiGPUError) -> Any:
    """``compile``: true/false, or a mapping of torch.compile's arguments from an allow-list."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise error(f"trainer setting compile={shown(value)} is invalid.",
                    "use true, false, or a mapping such as {mode: max-autotune, fullgraph: true}.")
    for key, item in value.items():
        if key == "options":
            if not isinstance(item, Mapping) or len(item) > 64:
                raise error(f"compile.options={shown(item)} is not a mapping of switches.", "e.g. {max_autotune: true}.")
            for option, switch in item.items():
                if option not in COMPILE_OPTIONS:
                    raise error(f"compile option {shown(option)} is not one a settings file may set.",
                                f"choose from {', '.join(COMPILE_OPTIONS)} (on/off switches); for anything else, call "
                                    "torch.compile on your model in your own code.")
                checked("compile.options", str(option), switch, Rule(bool), error)
        elif key in COMPILE_ARGUMENTS:
            checked("compile", str(key), item, COMPILE_ARGUMENTS[key], error)
        else:
            raise error(f"compile has no argument {shown(key)} a settings file may set.",
                        f"choose from {', '.join([*COMPILE_ARGUMENTS, 'options'])}.")
    return dict(value)


#: ``activation_checkpointing`` as a mapping: which blocks (class names) and how often.
CHECKPOINTING_KEYS = {"blocks": Rule(list, optional=True), "every": Rule(int, 1, 10**6)}


def activation_checkpointing_settings(value: Any, error: type[MultiGPUError] = MultiGPUError) -> Any:
    """``activation_checkpointing``: false, true (every repeated block), or ``{every: N, blocks: [Name]}``.

    Returned as false or ``{"blocks": [names] or None, "every": N}``: the one form the strategies read."""
    if isinstance(value, bool):
        return {"blocks": None, "every": 1} if value else False
    if not isinstance(value, Mapping) or not value:
        raise error(f"trainer setting activation_checkpointing={shown(value)} is invalid.",
                    "use true, false, {every: 2} (every 2nd block) or {blocks: [Block]} (class names).")
    for key, item in value.items():
        if key not in CHECKPOINTING_KEYS:
            raise error(f"activation_checkpointing has no key {shown(key)}.", "use every and/or blocks.")
        checked("activation_checkpointing", str(key), item, CHECKPOINTING_KEYS[key], error)
    blocks = value.get("blocks")
    if blocks is not None:
        if not blocks:
            raise error("activation_checkpointing.blocks=[] names no block.", "name a class, e.g. {blocks: [Block]}.")
        for name in blocks:
            plain_text(name, "activation_checkpointing block name", error, allow_space=False,
                       pattern=r"[A-Za-z_][A-Za-z0-9_]{0,199}", example="Block")
    return {"blocks": list(blocks) if blocks is not None else None, "every": value.get("every", 1)}


#: ``profile``: torch.profiler's schedule (in optimizer steps) and what it records.
PROFILE_KEYS = {"wait": Rule(int, 0, 10**6), "warmup": Rule(int, 0, 10**6), "active": Rule(int, 1, 1000),
                "repeat": Rule(int, 1, 1000), "record_shapes": Rule(bool), "profile_memory": Rule(bool),
                "with_stack": Rule(bool), "top": Rule(int, 0, 1000)}
PROFILE_DEFAULTS = {"wait": 1, "warmup": 1, "active": 3, "repeat": 1, "record_shapes": False, "profile_memory": False,
                    "with_stack": False, "top": 15}


def profile_settings(value: Any, error: type[MultiGPUError] = MultiGPUError) -> Any:
    """``profile``: false, true (wait 1, warmup 1, active 3), or a mapping of :data:`PROFILE_KEYS`.

    Returned as false or the full mapping with the defaults filled in."""
    if isinstance(value, bool):
        return dict(PROFILE_DEFAULTS) if value else False
    if not isinstance(value, Mapping):
        raise error(f"trainer setting profile={shown(value)} is invalid.",
                    "use true, false, or a mapping such as {wait: 1, warmup: 1, active: 3}.")
    for key, item in value.items():
        if key not in PROFILE_KEYS:
            raise error(f"profile has no key {shown(key)}.", f"choose from {', '.join(PROFILE_KEYS)}.")
        checked("profile", str(key), item, PROFILE_KEYS[key], error)
    settings = {**PROFILE_DEFAULTS, **value}
    if settings["with_stack"] and settings["wait"] + settings["warmup"] == 0:
        # torch 2.13's profiler: Python stacks recorded from the very first profiled step come back corrupt
        # (a UnicodeDecodeError in its event list, or SIGSEGV of the rank), measured here with the quickstart
        raise error("profile with_stack: true needs a step of wait or warmup before tracing: torch's profiler "
                    "corrupts the Python stacks it records from the first step (the rank ends in SIGSEGV).",
                    "set warmup: 1 (or wait: 1), or with_stack: false.")
    return settings
