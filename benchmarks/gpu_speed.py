"""Single-GPU speed: the Trainer against a hand-written loop of the same model, side by side in one run.

    python benchmarks/gpu_speed.py [--shape gpt2|char] [--batch 16] [--steps 50] [--repeats 5] [--profile]

Both paths train the same GPT (examples/char_gpt's model; ``gpt2``: 12 layers, 768 wide, 12 heads, block
1024, vocabulary 50304, tied head - GPT-2 124M's shape; ``char``: the char_gpt recipe's own shape) with
bf16 autocast, ``torch.compile`` and fused AdamW, from a DataLoader of token windows in pinned memory.
The hand-written loop is the loop of the PyTorch DDP tutorial on one GPU (to(device, non_blocking), autocast,
backward, step, zero_grad); the Trainer is ``mg.Trainer`` with its defaults (progress, watchdog,
preemption checks, step logging every 50 steps) - safety on, as users run it.

Interleaved: each repeat times ``--steps`` steps of the Trainer (one epoch of its fit), then the same
number of the hand loop; medians over ``--repeats``. Timed with CUDA events on the GPU's own timeline
(no host synchronisation inside the timed steps); the first step of each window is left out.

MFU = model FLOPs per token x tokens/s / peak dense bf16 FLOP/s (H100/H200 SXM: 989 TFLOP/s; A100 312;
``--peak-tflops`` to override). Model FLOPs per token: 6N + 12 x layers x block x width (PaLM's estimate,
attention included; N: parameters without the position embedding, the tied head counted once).

``--profile``: after the timing, a torch.profiler trace of a few Trainer steps: the top kernels by GPU
time and the CPU time per step, written to ``--trace-dir`` (default: outputs/gpu_speed) and summarised.
Needs a CUDA GPU; ``--cpu-dry-run`` runs the same code on the CPU (wall-clock timers, no MFU) to check
the script itself where there is none - its figures are not GPU figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
#: Dense bf16 peaks (TFLOP/s) by device name, most specific first (an H100 PCIe is not an SXM H100).
PEAKS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "H200": 989.4,
    "GH200": 989.4,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
}


def load_recipe():
    spec = importlib.util.spec_from_file_location(
        "char_gpt", HERE.parent / "examples" / "char_gpt" / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["char_gpt"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def shape(name: str, recipe) -> tuple[object, int]:
    """(ModelConfig, vocabulary) of the named shape."""
    if name == "gpt2":
        return recipe.ModelConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768), 50304
    from multigpu import config

    cfg = config.load(recipe.GPTConfig, HERE.parent / "examples" / "char_gpt" / "hparams.yaml")
    return cfg.model, len(set(recipe.load_text()))


def build(recipe, cfg, vocab: int, tie: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = recipe.make_gpt(vocab, cfg)
    if tie:
        model[-1].weight = model[0].tokens.weight  # GPT-2 ties the head to the token embedding
    return model


def model_flops_per_token(model: torch.nn.Module, cfg) -> int:
    # unique parameters
    n = sum(p.numel() for p in model.parameters()) - model[0].positions.weight.numel()
    return 6 * n + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=("gpt2", "char"), default="gpt2")
    parser.add_argument("--batch", type=int, help="sequences per step (default: gpt2 16, char 64)")
    parser.add_argument(
        "--steps",
        type=int,
        default=50,
        help="timed steps per window (with the default, each "
        "Trainer window holds about one of its step rows, logged every 50 steps)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--trace-dir",
        default="outputs/gpu_speed",
        help="where --profile writes its table and trace",
    )
    parser.add_argument("--peak-tflops", type=float)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="check the script on the CPU (no GPU figures)"
    )
    args = parser.parse_args()
    if args.steps < 6 or args.repeats < 1:
        sys.exit("gpu_speed.py: --steps must be at least 6 and --repeats at least 1")
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        sys.exit("gpu_speed.py needs a CUDA GPU (--cpu-dry-run checks the script on the CPU)")
    import multigpu as mg

    recipe = load_recipe()
    cfg, vocab = shape(args.shape, recipe)
    batch = args.batch or (16 if args.shape == "gpt2" else 64)
    compiled = not args.no_compile
    run = mg.init(seed=0, accelerator="cpu" if args.cpu_dry_run else "cuda")
    device = run.device
    event = (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else WallEvent
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    g = torch.Generator().manual_seed(0)
    windows = batch * (args.steps + 1)
    tokens = torch.randint(0, vocab, (windows, cfg.block_size + 1), generator=g)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    # ---- the hand-written loop
    hand_model = build(recipe, cfg, vocab, tie=args.shape == "gpt2").to(device)
    flops_per_token = model_flops_per_token(hand_model, cfg)
    n_params = sum(p.numel() for p in hand_model.parameters())
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    hand_step_model = torch.compile(hand_model) if compiled else hand_model
    hand_loader = DataLoader(
        data, batch_size=batch, shuffle=True, drop_last=True, pin_memory=device.type == "cuda"
    )

    def hand_window() -> float:
        start, end = event(), event()
        hand_step_model.train()
        for i, (x, y) in enumerate(hand_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = hand_step_model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)
            if i == 0:
                start.record()
            if i == args.steps:
                end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / args.steps

    # ---- the Trainer: one epoch per window; the hand loop runs between its epochs
    timings: dict[str, list[float]] = {"trainer": [], "hand": []}
    profiled = args.repeats + 2  # the epoch after the timed ones, with --profile
    profiler = Profiler(Path(args.trace_dir)) if args.profile else None

    class Timed(recipe.GPTTrainer):
        def on_epoch_start(self, epoch):
            self._n = 0
            self._start, self._end = event(), event()
            if epoch == profiled:
                profiler.start()

        def on_train_batch_end(self, step, loss):
            self._n += 1
            if self._n == 1:
                self._start.record()
            elif self._n == args.steps + 1:
                self._end.record()
            if profiler is not None and profiler.active:
                profiler.step()

        def on_epoch_end(self, epoch, metrics):
            if epoch == profiled:
                return
            self._end.synchronize()
            seconds = self._start.elapsed_time(self._end) / 1e3 / args.steps
            hand = hand_window()
            if epoch > 1:  # the first epoch of each path compiles
                timings["trainer"].append(seconds)
                timings["hand"].append(hand)

    trainer_model = build(recipe, cfg, vocab, tie=args.shape == "gpt2")
    # its final checkpoint is not a figure
    scratch = tempfile.TemporaryDirectory(prefix="gpu_speed-")
    trainer = Timed(
        run,
        trainer_model,
        lambda p: torch.optim.AdamW(p, lr=3e-4, weight_decay=0.1, fused=True),
        epochs=args.repeats + 1 + bool(args.profile),
        batch_size=batch,
        precision="bf16",
        compile=compiled,
        drop_last=True,
        out_dir=scratch.name,
        resume=False,
        checkpoint_every_epochs=10**6,
        plot=False,
        progress_every_s=3600,
    )
    wall = time.perf_counter()
    trainer.fit(data)
    wall = time.perf_counter() - wall

    name = (
        torch.cuda.get_device_name() if device.type == "cuda" else "CPU dry run (not GPU figures)"
    )
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), None)
    tokens_per_step = batch * cfg.block_size
    rows = {}
    for path, values in timings.items():
        step_s = statistics.median(values)
        tokens_per_s = tokens_per_step / step_s
        rows[path] = {
            "step_ms": step_s * 1e3,
            "min_ms": min(values) * 1e3,
            "max_ms": max(values) * 1e3,
            "tokens_per_s": tokens_per_s,
            "mfu": flops_per_token * tokens_per_s / (peak * 1e12) if peak else None,
        }
    ratio = rows["trainer"]["step_ms"] / rows["hand"]["step_ms"]
    print(
        f"{name}; torch {torch.__version__}; CUDA {torch.version.cuda}; shape {args.shape}: "
        f"{n_params / 1e6:.1f}M parameters, {cfg.n_layer} layers x {cfg.n_embd} wide, block {cfg.block_size}, "
        f"vocabulary {vocab}; batch {batch} x {cfg.block_size} tokens; bf16{', compiled' if compiled else ''}; "
        f"{args.repeats} interleaved repeats of {args.steps} steps (wall {wall:.0f} s incl. compiling)"
    )
    print(f"{'path':<10}{'step ms (median)':>18}{'min-max':>16}{'tokens/s':>14}{'MFU':>8}")
    for path, row in rows.items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "?"
        print(
            f"{path:<10}{row['step_ms']:>18.2f}{row['min_ms']:>8.2f}-{row['max_ms']:<7.2f}"
            f"{row['tokens_per_s']:>14,.0f}{mfu:>8}"
        )
    print(f"Trainer / hand-written loop: {ratio:.3f}x (goal <= 1.02)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "shape": args.shape,
                    "batch": batch,
                    "params": n_params,
                    "rows": rows,
                    "ratio": ratio,
                    "flops_per_token": flops_per_token,
                    "peak_tflops": peak,
                },
                indent=1,
            )
        )
    if profiler is not None:
        profiler.report()
    run.close()
    scratch.cleanup()


class WallEvent:
    """``torch.cuda.Event``'s three calls on the host clock, for ``--cpu-dry-run``."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "WallEvent") -> float:
        return (end.at - self.at) * 1e3


class Profiler:
    """torch.profiler over a few Trainer steps: what bounds the step (kernels, or the host)."""

    STEPS = 6  # 1 skipped, 1 warm-up, 4 recorded

    def __init__(self, trace_dir: Path) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.trace_dir = trace_dir
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
        )
        self.prof = profile(
            activities=activities, schedule=schedule(wait=1, warmup=1, active=self.STEPS - 2)
        )
        self.active, self.done = False, 0

    def start(self) -> None:
        self.prof.start()
        self.active = True

    def step(self) -> None:
        self.prof.step()
        self.done += 1
        if self.done == self.STEPS:
            self.prof.stop()
            self.active = False

    def report(self) -> None:
        if self.done < self.STEPS:
            print(f"profile: only {self.done} steps ran; raise --steps")
            return
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        events = self.prof.key_averages()
        table = events.table(sort_by="self_device_time_total", row_limit=15)
        (self.trace_dir / "profile.txt").write_text(table)
        self.prof.export_chrome_trace(str(self.trace_dir / "trace.json"))
        active = self.STEPS - 2
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / active
        cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / active
        print(table)
        print(
            f"profiled {active} Trainer steps: kernels {gpu_ms:.2f} ms/step of GPU time, host {cpu_ms:.2f} ms/step "
            f"of CPU time (all threads); {self.trace_dir / 'profile.txt'}, {self.trace_dir / 'trace.json'}"
        )


if __name__ == "__main__":
    main()
