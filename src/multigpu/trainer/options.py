"""The checks of the Trainer settings that are mappings: ``compile`` and ``profile``.

Why a module of its own: these two hand a settings file's values to torch.compile and torch.profiler,
so what a file may set is an allow-list (data must not choose what a compiler runs or where a trace is
written). Standard library only: a bad value is refused before torch loads.
"""

from __future__ import annotations

from typing import Any, Mapping

from multigpu.errors import MultiGPUError, shown
from multigpu.validate import Rule, checked

#: torch.compile's own arguments, and the inductor options (all on/off switches) a settings file may
#: set. Anything else - above all a free string such as ``cpp.march`` or ``cpp.cxx``, which reach the C++
#: compiler's command line (``-wrapper /bin/sh`` runs a program), or ``trace.debug_dir`` (a folder
#: written to) - is refused: a settings file is data, and data must not choose what a compiler runs.
COMPILE_ARGUMENTS = {
    "fullgraph": Rule(bool),
    "dynamic": Rule(bool, optional=True),
    "backend": Rule(str, choices=("inductor", "eager", "aot_eager", "cudagraphs")),
    "mode": Rule(
        str,
        optional=True,
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    ),
}


COMPILE_OPTIONS = (
    "max_autotune",
    "max_autotune_gemm",
    "max_autotune_pointwise",
    "epilogue_fusion",
    "coordinate_descent_tuning",
    "shape_padding",
    "freezing",
    "aggressive_fusion",
    "triton.cudagraphs",
    "triton.cudagraph_trees",
    "benchmark_kernel",
    "layout_optimization",
    "memory_planning",
    "split_reductions",
)


def compile_settings(value: Any, error: type[MultiGPUError] = MultiGPUError) -> Any:
    """``compile``: true/false, or a mapping of torch.compile's arguments from an allow-list."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, Mapping):
        raise error(
            f"trainer setting compile={shown(value)} is invalid.",
            "use true, false, or a mapping such as {mode: max-autotune, fullgraph: true}.",
        )
    for key, item in value.items():
        if key == "options":
            if not isinstance(item, Mapping) or len(item) > 64:
                raise error(
                    f"compile.options={shown(item)} is not a mapping of switches.",
                    "e.g. {max_autotune: true}.",
                )
            for option, switch in item.items():
                if option not in COMPILE_OPTIONS:
                    raise error(
                        f"compile option {shown(option)} is not one a settings file may set.",
                        f"choose from {', '.join(COMPILE_OPTIONS)} (on/off switches); for anything else, call "
                        "torch.compile on your model in your own code.",
                    )
                checked("compile.options", str(option), switch, Rule(bool), error)
        elif key in COMPILE_ARGUMENTS:
            checked("compile", str(key), item, COMPILE_ARGUMENTS[key], error)
        else:
            raise error(
                f"compile has no argument {shown(key)} a settings file may set.",
                f"choose from {', '.join([*COMPILE_ARGUMENTS, 'options'])}.",
            )
    return dict(value)


#: ``profile``: torch.profiler's schedule (in optimizer steps) and what it records.
PROFILE_KEYS = {
    "wait": Rule(int, 0, 10**6),
    "warmup": Rule(int, 0, 10**6),
    "active": Rule(int, 1, 1000),
    "repeat": Rule(int, 1, 1000),
    "record_shapes": Rule(bool),
    "profile_memory": Rule(bool),
    "with_stack": Rule(bool),
    "top": Rule(int, 0, 1000),
}


PROFILE_DEFAULTS = {
    "wait": 1,
    "warmup": 1,
    "active": 3,
    "repeat": 1,
    "record_shapes": False,
    "profile_memory": False,
    "with_stack": False,
    "top": 15,
}


def profile_settings(value: Any, error: type[MultiGPUError] = MultiGPUError) -> Any:
    """``profile``: false, true (wait 1, warmup 1, active 3), or a mapping of :data:`PROFILE_KEYS`.

    Returned as false or the full mapping with the defaults filled in."""
    if isinstance(value, bool):
        return dict(PROFILE_DEFAULTS) if value else False
    if not isinstance(value, Mapping):
        raise error(
            f"trainer setting profile={shown(value)} is invalid.",
            "use true, false, or a mapping such as {wait: 1, warmup: 1, active: 3}.",
        )
    for key, item in value.items():
        if key not in PROFILE_KEYS:
            raise error(
                f"profile has no key {shown(key)}.", f"choose from {', '.join(PROFILE_KEYS)}."
            )
        checked("profile", str(key), item, PROFILE_KEYS[key], error)
    settings = {**PROFILE_DEFAULTS, **value}
    if settings["with_stack"] and settings["wait"] + settings["warmup"] == 0:
        # torch 2.13's profiler: Python stacks recorded from the very first profiled step come back corrupt
        # (a UnicodeDecodeError in its event list, or SIGSEGV of the rank), measured here with the quickstart
        raise error(
            "profile with_stack: true needs a step of wait or warmup before tracing: torch's profiler "
            "corrupts the Python stacks it records from the first step (the rank ends in SIGSEGV).",
            "set warmup: 1 (or wait: 1), or with_stack: false.",
        )
    return settings
