"""Single-GPU speed of the char_gpt model through the Trainer: tokens/s and model-FLOPs utilisation.

    python benchmarks/char_gpt_speed.py [--precision bf16] [--compile] [--n-layer 8 --n-embd 512 --block 256]

MFU = achieved model FLOP/s / the GPU's peak dense bf16 FLOP/s (H100/H200 SXM: 989 TFLOP/s; A100: 312;
override with --peak-tflops). Model FLOPs per token: 6 x parameters + 12 x layers x block x width
(PaLM's estimate, attention included). Needs a CUDA GPU.
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
PEAKS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def load_recipe():
    spec = importlib.util.spec_from_file_location("char_gpt", HERE.parent / "examples" / "char_gpt" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--peak-tflops", type=float)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    recipe = load_recipe()
    import multigpu as mg

    run = mg.init(seed=0)
    cfg = recipe.ModelConfig(block_size=args.block, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    vocab = 128
    model = recipe.make_gpt(vocab, cfg)
    if args.compile:
        model = torch.compile(model)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = run.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True))
    from multigpu.precision import Precision

    precision = Precision(args.precision, run.device)
    x = torch.randint(0, vocab, (args.batch, args.block), device=run.device)
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with precision.autocast():
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), x.reshape(-1))
        precision.scale(loss).backward()
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 10:
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    tokens_per_s = args.batch * args.block / step_s
    flops_per_token = 6 * n_params + 12 * args.n_layer * args.block * args.n_embd
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), None)
    print(f"{name}: {n_params / 1e6:.1f}M parameters, {args.precision}{' compiled' if args.compile else ''}, "
          f"batch {args.batch} x {args.block} tokens")
    print(f"  step {step_s * 1e3:.2f} ms (median of {len(times)}), {tokens_per_s:,.0f} tokens/s")
    if peak:
        print(f"  MFU {flops_per_token * tokens_per_s / (peak * 1e12):.1%} of {peak:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
