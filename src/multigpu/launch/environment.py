"""Which of your environment variables a launch passes on, and the values it refuses.

Why a module of its own: a runs file or a shell can set variables that load a library (LD_PRELOAD),
import a module (PYTHONWARNINGS), steer the launcher (MASTER_*) or send your credentials to a server
the file chose (WANDB_BASE_URL). The queue, the Slurm scripts and the local launcher pass the
environment on through these rules only: each variable a runs file may set is named here with why it
is harmless, and every value is checked before any process starts. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from multigpu.errors import MultiGPUError, shown
from multigpu.validate import CONTROL, is_digits

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")


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
    # or text matching this (else: plain text of at most 200 characters)
    pattern: Optional[str] = None

    def problem(self, value: str) -> Optional[str]:
        """Why ``value`` is not one of these (None: it is)."""
        if self.words and value.lower() in self.words:
            return None
        if self.low is not None and self.high is not None and is_digits(value):
            return (
                None
                if self.low <= int(value) <= self.high
                else f"is outside {self.low}..{self.high}"
            )
        if self.pattern is not None and re.fullmatch(self.pattern, value):
            return None
        if not self.words and self.low is None and self.pattern is None:
            return (
                None
                if len(value) <= 200 and not CONTROL.search(value)
                else "is not short plain text"
            )
        want = [f"a whole number from {self.low} to {self.high}"] if self.low is not None else []
        want += [f"one of {', '.join(self.words[:8])}"] if self.words else []
        want += [f"text like {self.pattern[:40]}"] if self.pattern else []
        return "is not " + " or ".join(want)


_THREADS = EnvValue("CPU threads", 1, 4096)


_ON_OFF = ("0", "1")


_BOOL_WORDS = ("0", "1", "true", "false", "yes", "no", "on", "off")


# NCCL's interface/HCA lists: ^eth,=ib0:1
_NAMES = r"[\^=]?[\w.:-]{1,64}(,[\^=]?[\w.:-]{1,64}){0,31}"


# comma-separated words (NCCL_ALGO, NCCL_DEBUG_SUBSYS)
_WORDS = r"[\w.^-]{1,64}(,[\w.^-]{1,64}){0,63}"


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
    **dict.fromkeys(
        ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"),
        _THREADS,
    ),
    "KMP_AFFINITY": EnvValue("CPU threads", pattern=r"[\w,=.\[\]-]{1,200}"),
    "KMP_BLOCKTIME": EnvValue("CPU threads", 0, 10**7, words=("infinite",)),
    "TOKENIZERS_PARALLELISM": EnvValue("CPU threads", words=_BOOL_WORDS),
    "NCCL_DEBUG": EnvValue(_COLLECTIVES, words=("version", "warn", "info", "abort", "trace")),
    "NCCL_DEBUG_SUBSYS": EnvValue(_COLLECTIVES, pattern=_WORDS),
    **dict.fromkeys(
        ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_IB_HCA"),
        EnvValue(_COLLECTIVES, pattern=_NAMES),
    ),
    **dict.fromkeys(
        ("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"),
        EnvValue(_COLLECTIVES, words=_ON_OFF),
    ),
    "NCCL_CROSS_NIC": EnvValue(_COLLECTIVES, 0, 2),
    "NCCL_IB_TIMEOUT": EnvValue(_COLLECTIVES, 1, 31),
    **dict.fromkeys(
        ("NCCL_P2P_LEVEL", "NCCL_NET_GDR_LEVEL"),
        EnvValue(_COLLECTIVES, 0, 10, words=("loc", "nvl", "pix", "pxb", "phb", "sys")),
    ),
    **dict.fromkeys(("NCCL_ALGO", "NCCL_PROTO"), EnvValue(_COLLECTIVES, pattern=_WORDS)),
    "NCCL_NTHREADS": EnvValue(_COLLECTIVES, 1, 1024),
    "NCCL_BUFFSIZE": EnvValue(_COLLECTIVES, 1, 2**40),
    **dict.fromkeys(("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"), EnvValue(_COLLECTIVES, 1, 1024)),
    **dict.fromkeys(
        ("CUDA_LAUNCH_BLOCKING", "NVIDIA_TF32_OVERRIDE"), EnvValue("GPU behaviour", words=_ON_OFF)
    ),
    "CUDA_DEVICE_MAX_CONNECTIONS": EnvValue("GPU behaviour", 1, 32),
    "CUDA_MODULE_LOADING": EnvValue("GPU behaviour", words=("lazy", "eager")),
    "CUBLAS_WORKSPACE_CONFIG": EnvValue(
        "GPU behaviour", pattern=r":[0-9]{1,9}:[0-9]{1,9}(,:[0-9]{1,9}:[0-9]{1,9}){0,7}"
    ),
    "PYTORCH_CUDA_ALLOC_CONF": EnvValue(
        "GPU behaviour", pattern=r"[\w.]{1,64}:[\w.]{1,64}(,[\w.]{1,64}:[\w.]{1,64}){0,15}"
    ),
    "TORCH_DISTRIBUTED_DEBUG": EnvValue(_TORCH, words=("off", "info", "detail")),
    "TORCH_SHOW_CPP_STACKTRACES": EnvValue(_TORCH, words=_ON_OFF),
    "TORCH_CPP_LOG_LEVEL": EnvValue(_TORCH, 0, 3, words=("info", "warning", "error", "fatal")),
    # the names torch knows are checked by torch's own parser, in the run's launcher (launch.local)
    "TORCH_LOGS": EnvValue(_TORCH, pattern=r"[+-]?[\w.]{1,64}(,[+-]?[\w.]{1,64}){0,63}"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": EnvValue(_TORCH, 0, 3),
    **dict.fromkeys(
        (
            "TORCH_NCCL_BLOCKING_WAIT",
            "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_NCCL_ENABLE_MONITORING",
            "TORCHINDUCTOR_MAX_AUTOTUNE",
            "TORCHINDUCTOR_FREEZING",
        ),
        EnvValue(_TORCH, words=_ON_OFF),
    ),
    **dict.fromkeys(
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), EnvValue(_TORCH, 0, 10**7)
    ),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": EnvValue(_TORCH, 1, 10**6),
    **dict.fromkeys(
        (
            "HF_HUB_OFFLINE",
            "HF_DATASETS_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_HUB_DISABLE_TELEMETRY",
        ),
        EnvValue(_HF, words=_BOOL_WORDS),
    ),
    **dict.fromkeys(
        ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY"), EnvValue(_HF, words=_VERBOSITY)
    ),
    "WANDB_MODE": EnvValue(
        _LOGGERS, words=("online", "offline", "disabled", "dryrun", "run", "shared")
    ),
    **dict.fromkeys(
        ("WANDB_PROJECT", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_NOTES", "MLFLOW_EXPERIMENT_NAME"),
        EnvValue(_LOGGERS),
    ),
    **dict.fromkeys(("WANDB_SILENT", "WANDB_DISABLE_CODE"), EnvValue(_LOGGERS, words=_BOOL_WORDS)),
    "WANDB_CONSOLE": EnvValue(
        _LOGGERS, words=("auto", "off", "wrap", "redirect", "wrap_raw", "wrap_emu")
    ),
    "PYTHONHASHSEED": EnvValue("Python hashing and output", 0, 4294967295, words=("random",)),
    **dict.fromkeys(
        ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER"),
        EnvValue("Python hashing and output", pattern=r"[\w]{1,16}"),
    ),
}


#: Why each allow-listed name is harmless (the table above, by name).
ENV_ALLOWED = {name: rule.why for name, rule in ENV_VALUES.items()}


#: Values that reach the launcher from its own environment and would end every rank before its first line:
#: checked by ``multigpu run`` itself (:func:`launch_environment`).
#: (PYTHONHASHSEED's own interpreter dies before any line of ours runs: a runs file's is checked by the queue.)
CHECKED_AT_LAUNCH = ("TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS")


#: Parts of a name that say it points somewhere or grants something: never allowed by the table above.
ENV_POINTING_PARTS = (
    "URL",
    "URI",
    "ENDPOINT",
    "HOST",
    "ADDR",
    "SERVER",
    "TOKEN",
    "KEY",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "AUTH",
    "FILE",
    "DIR",
    "PATH",
    "HOME",
    "CACHE",
    "LIBRARY",
    "PLUGIN",
    "PRELOAD",
    "HOOK",
    "EXEC",
    "CONFIG",
)


#: Names that say where a process sends data: when a runs file sets one, credentials stay out of that run.
ENV_ENDPOINT_PARTS = ("URL", "URI", "ENDPOINT", "HOST", "ADDR", "SERVER", "PROXY")


#: Credentials a process inherits from your shell: never passed to a run whose endpoints came from a file.
ENV_CREDENTIAL_PARTS = (
    "TOKEN",
    "KEY",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "CREDENTIAL",
    "AUTH",
    "NETRC",
)


#: Set by the queue and the launcher for every run: never from a runs file.
ENV_RESERVED = ("CUDA_VISIBLE_DEVICES",)


def env_name(name: object, error: type[MultiGPUError] = MultiGPUError, where: str = "") -> str:
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        raise error(
            f"{where}environment variable name {shown} is not an identifier.",
            "use letters, digits and _ (not starting with a digit).",
        )
    return name


def env_value(
    name: str, value: object, error: type[MultiGPUError] = MultiGPUError, where: str = ""
) -> str:
    """``value`` of the variable ``name``, checked by its rule (:data:`ENV_VALUES`; a name without one:
    plain text) - also for a name ``--allow-env`` admitted: the value would end the run all the same."""
    text = str(value)
    rule = ENV_VALUES.get(name, EnvValue(""))
    problem = rule.problem(text)
    if problem is not None:
        example = (
            rule.words[0]
            if rule.words
            else (str(rule.low) if rule.low is not None else "a short value")
        )
        raise error(
            f"{where}environment variable {name}={shown(text, 60)} {problem}.",
            f"give {name} a value its library takes (e.g. {example}), or remove it.",
        )
    return text


def launch_environment(
    environ: Mapping[str, str], error: type[MultiGPUError] = MultiGPUError
) -> None:
    """The launcher's own environment, before it starts anything: the values of :data:`CHECKED_AT_LAUNCH`
    that every rank would die of."""
    for name in CHECKED_AT_LAUNCH:
        if environ.get(name):
            env_value(name, environ[name], error)


def env_allowed(
    name: str,
    allowed: Sequence[str] = (),
    error: type[MultiGPUError] = MultiGPUError,
    where: str = "",
) -> str:
    """A runs file's variable: one of :data:`ENV_ALLOWED`, or named by ``--allow-env`` (never a reserved one)."""
    if name in ENV_RESERVED:
        raise error(
            f"{where}environment variable {name} is set by the queue for every run.",
            "remove it: the queue chooses each run's GPUs.",
        )
    if name in allowed or name in ENV_ALLOWED:
        return name
    pointing = [part for part in ENV_POINTING_PARTS if part in name]
    why = (
        f"names a {pointing[0].lower()}"
        if pointing
        else "is not one of the library settings a runs file may set"
    )
    raise error(
        f"{where}environment variable {name} {why}; a runs file may not set it on its own.",
        f"if you trust this runs file, allow it: `multigpu queue ... --allow-env {name}` (or set it in your own "
        "shell before starting the queue).",
    )


def run_environment(
    inherited: Mapping[str, str], from_file: Mapping[str, str]
) -> tuple[dict[str, str], list[str]]:
    """The environment of a run started from a runs file, and the names of credentials held back.

    When the file sets where a run sends data (a URL, URI, endpoint, host - allowed by ``--allow-env``),
    the credentials of your shell (tokens, keys, passwords) are not passed on, unless the file sets
    them itself - which also needs ``--allow-env``: a file chooses a server *and* your key only when you
    said both names."""
    env = dict(inherited)
    held: list[str] = []
    if any(part in name for name in from_file for part in ENV_ENDPOINT_PARTS):
        held = sorted(
            name
            for name in env
            if any(part in name.upper() for part in ENV_CREDENTIAL_PARTS) and name not in from_file
        )
        for name in held:
            del env[name]
    env.update(from_file)
    return env, held
