"""nanoGPT's train.py, ported to multigpu: the same structure - module-level settings overridden by
``--key=value``, a hand-written loop with gradient accumulation, a GradScaler for float16, a cosine
learning rate with warmup, evaluation and checkpoints every ``eval_interval`` iterations - on a small
character corpus made locally (prepare.py; no download).

    multigpu run --nproc 2 examples/nanogpt/train.py --max_iters=200           # torchrun's place
    multigpu check --nproc 2 --steps 3 examples/nanogpt/train.py                # 2 processes = 1 process?
    python examples/nanogpt/train.py --max_iters=20                             # one process, no launcher

Each change from nanoGPT is marked ``multigpu:``; docs/migrating.md explains them. In short:
- ``run = mg.init(seed=1337)`` replaces init_process_group, the device choice and the per-rank seed;
- batches come from an *offsets Dataset* through ``run.loader`` instead of ``get_batch``'s
  ``torch.randint``: every rank reads its own random windows, and ``multigpu check`` can scale them;
- ``gradient_accumulation_steps`` is per process (nanoGPT divides it by the world size): the global
  batch is ``batch_size x processes x gradient_accumulation_steps``;
- ``run.no_sync(model)`` around the micro-steps before the last (nanoGPT toggles
  ``model.require_backward_grad_sync`` - equivalent, and shown in docs/migrating.md);
- every rank evaluates its share (exact means through ``run.reduce``) and every rank calls
  ``run.save_checkpoint``: the "best" decision is the same everywhere, the files are atomic and verified.
"""

from __future__ import annotations

import ast
import contextlib
import json
import math
import os
import sys
import time

import numpy as np
import torch
from model import GPT, GPTConfig
from prepare import prepare
from torch.utils.data import Dataset, Subset

import multigpu as mg
from multigpu.errors import ConfigError

# -----------------------------------------------------------------------------
# default settings: a ~0.1M-parameter model that learns the corpus in a few minutes on 2 CPU cores
out_dir = "outputs/nanogpt"
eval_interval = 50
log_interval = 10
eval_iters = 20
eval_only = False
# nanoGPT's default is True; here only an improved validation loss saves
always_save_checkpoint = False
init_from = "scratch"  # 'scratch' or 'resume' (the newest checkpoint in out_dir that verifies)
data_dir = "outputs/nanogpt/data"  # made by prepare.py on first use
gradient_accumulation_steps = 2  # multigpu: per process - the same on any number of processes
batch_size = 8  # per process and micro-step
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
bias = False
learning_rate = 3e-3
max_iters = 300
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 20
lr_decay_iters = 300
min_lr = 3e-4
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
# nanoGPT: True (torch.compile); off here, where the model is tiny and the tests run on CPUs
compile = False
# -----------------------------------------------------------------------------


def configure(settings: dict, argv: list[str]) -> dict:
    """``--key=value`` overrides of the settings above (nanoGPT's configurator, without exec):
    a value is a Python literal of the setting's type, or a plain string for a string setting."""
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not key.startswith("--") or not sep:
            raise ConfigError(
                f"argument {arg!r} is not --key=value.", "e.g. --max_iters=100 --batch_size=16."
            )
        key = key[2:]
        if key not in settings:
            raise ConfigError(
                f"--{key} is not a setting of this script.",
                f"one of: {', '.join(sorted(settings))}.",
            )
        try:
            value = ast.literal_eval(text)
        except (SyntaxError, ValueError):
            value = text
        wanted = type(settings[key])
        if wanted is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not wanted:
            raise ConfigError(
                f"--{key}={text}: expected a {wanted.__name__}.", f"e.g. --{key}={settings[key]!r}."
            )
        settings[key] = value
    return settings


config = configure(
    {
        k: v
        for k, v in globals().items()
        if not k.startswith("_") and isinstance(v, (int, float, bool, str))
    },
    sys.argv[1:],
)
globals().update(config)

# multigpu: one line replaces init_process_group, LOCAL_RANK/WORLD_SIZE, set_device and the seeds.
# The seed is the same on every rank now (identical initial weights) and differs per rank after
# run.setup (dropout), as nanoGPT's `torch.manual_seed(1337 + seed_offset)` intends.
run = mg.init(seed=1337)
master_process = run.is_main
device = run.device
device_type = device.type
tokens_per_iter = gradient_accumulation_steps * run.world_size * batch_size * block_size
run.print(f"tokens per iteration will be: {tokens_per_iter:,}")
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = (
    contextlib.nullcontext()
    if device_type == "cpu"
    else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
)

# multigpu: once, on rank 0, while the others wait (they poll; no collective timeout however long it takes).
# On every rank, unconditionally: prepare skips a folder it made before. (Under `if not exists(meta.json)`
# a late rank would see the file rank 0 has just made and skip the call.)
mg.run_on_main(prepare, data_dir)
with open(os.path.join(data_dir, "meta.json")) as f:
    meta = json.load(f)


class Offsets(Dataset):
    """multigpu: nanoGPT's get_batch draws ``torch.randint`` offsets; here every offset is a sample.
    run.loader shuffles them each epoch and gives each rank its own share - random windows, different
    on every rank, without repeats within an epoch - and multigpu check can scale the batch."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.length = len(np.memmap(path, dtype=np.uint16, mode="r")) - block_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        # reopened, as nanoGPT does, to avoid a leak
        data = np.memmap(self.path, dtype=np.uint16, mode="r")
        chunk = torch.from_numpy(data[i : i + block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


train_set = Offsets(os.path.join(data_dir, "train.bin"))
val_set = Offsets(os.path.join(data_dir, "val.bin"))
# Evaluation: eval_iters x batch_size fixed windows per split, spread over the split, read once across
# the ranks (run.eval_loader) - the same windows on any number of processes.
evaluation = {
    name: Subset(ds, range(0, len(ds), max(1, len(ds) // (eval_iters * batch_size))))
    for name, ds in (("train", train_set), ("val", val_set))
}

iter_num = 0
best_val_loss = 1e9
model_args = dict(
    n_layer=n_layer,
    n_head=n_head,
    n_embd=n_embd,
    block_size=block_size,
    bias=bias,
    vocab_size=meta["vocab_size"],
    dropout=dropout,
)
model = GPT(GPTConfig(**model_args)).to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if compile:
    model = torch.compile(model)
# multigpu: replaces DDP(model, device_ids=[ddp_local_rank]) (or FSDP with mg.init(strategy="fsdp")).
model, optimizer = run.setup(model, optimizer)
train_loader = run.loader(train_set, batch_size, seed=1337)
ckpt_dir = os.path.join(out_dir, "checkpoints")
if init_from == "resume":
    # multigpu: the newest checkpoint that verifies, the same on every rank; model and optimizer in place.
    state = run.load_checkpoint(ckpt_dir, model, optimizer)
    if state is None:
        raise ConfigError(
            f"init_from='resume' but {ckpt_dir} holds no checkpoint.",
            "train with init_from='scratch' first.",
        )
    iter_num, best_val_loss = state["iter_num"], state["best_val_loss"]
    train_loader.resume_at(*state["position"])


def forever(loader):
    while True:  # run.loader reshuffles every epoch by itself
        yield from loader


@torch.no_grad()
def estimate_loss() -> dict:
    """multigpu: every rank evaluates its share; run.reduce gives the exact mean (sums and counts)."""
    out = {}
    model.eval()
    for split, windows in evaluation.items():
        total, count = torch.zeros((), dtype=torch.float64), 0
        for x, y in run.eval_loader(windows, batch_size):
            with ctx:
                _, loss = model(x.to(device), y.to(device))
            total += loss.double().cpu() * len(x)
            count += len(x)
        out[split] = run.reduce({"loss": (total, count)})["loss"]
    model.train()
    return out


def get_lr(it: int) -> float:
    """Linear warmup for warmup_iters, then a cosine from learning_rate down to min_lr at lr_decay_iters."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


batches = forever(train_loader)
X, Y = (t.to(device) for t in next(batches))
t0 = time.time()
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr

    # multigpu: every rank evaluates and decides (was: `and master_process`), so every rank reaches
    # run.save_checkpoint - a collective - with the same answer.
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        run.print(
            f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
        )
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                run.save_checkpoint(
                    ckpt_dir,
                    iter_num,
                    {
                        "model": model,
                        "optimizer": optimizer,
                        "model_args": model_args,
                        "iter_num": iter_num,
                        "best_val_loss": best_val_loss,
                        "config": config,
                        "position": list(train_loader.position()),
                    },
                    keep_last=1,
                )
                run.print(f"saved a checkpoint to {ckpt_dir}")
    if iter_num == 0 and eval_only:
        break

    for micro_step in range(gradient_accumulation_steps):
        last = micro_step == gradient_accumulation_steps - 1
        # multigpu: no gradient all-reduce except on the last micro-step (nanoGPT sets
        # model.require_backward_grad_sync = last, which is what no_sync does for DDP).
        with contextlib.nullcontext() if last else run.no_sync(model):
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = (t.to(device) for t in next(batches))  # the next batch, while the GPU works
            run.backward(scaler.scale(loss))
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0:
        # undo the division: this micro-step's loss
        lossf = loss.item() * gradient_accumulation_steps
        run.print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
    iter_num += 1
    run.step_done(iter_num)  # multigpu: the hang watchdog's heartbeat (when configured)
    if iter_num > max_iters:
        break

if master_process:
    itos = meta["itos"]
    start = torch.tensor([[meta["itos"].index("T")]], device=device)
    sample = run.unwrap(model).generate(start, max_new_tokens=120, temperature=0.8)[0].tolist()
    print("sample:", "".join(itos[i] for i in sample))
