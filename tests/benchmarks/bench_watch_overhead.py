"""What ``rw.watch`` costs a training loop, measured as users run one. Prints JSON; not part of the suite.

Two parts:

- ``host``, on any machine: runwatch's own host time per step for 150 parameter tensors (its calls
  plus the CPU its threads spend per event) and the tensor operations it adds per step
  (``watch_host_cost.py``). The figure to track where there is no GPU.
- ``loops``, a GPT-style model trained bare and watched: ``small`` (~9M parameters, 77 tensors,
  batch 8 x 128: on a fast GPU the loop is host-bound), ``mid`` (~163M, 149 tensors, 16 x 1024) and
  ``large`` (~1.4B, 293 tensors, 8 x 1024; GPU only), each with the broker reachable and not.
  bf16 autocast and fused AdamW on CUDA. The bare loop clips with ``clip_grad_norm_`` and reads its
  loss every 10 steps; the watched one lets runwatch clip and publish every step. Steps are timed in
  blocks with one device sync at each end, bare and watched blocks alternating, as a real loop runs:
  a sync per step would hide the host cost (the GPU would wait for Python in both arms alike). The
  ratio is of the median block times. With ``--sync-check`` (CUDA) the watched blocks run under
  ``torch.cuda.set_sync_debug_mode("warn")`` and every synchronizing call is counted.

    .venv/bin/python tests/benchmarks/bench_watch_overhead.py                # CPU: host part + small loop
    python tests/benchmarks/bench_watch_overhead.py --device cuda --configs small,mid,large --sync-check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from watch_host_cost import count_ops, measure

from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.producer import RunWatch

# name: (vocab, width, layers, heads, batch, seq)
CONFIGS = {
    "small": (8192, 256, 6, 4, 8, 128),
    "mid": (50304, 768, 12, 12, 16, 1024),
    "large": (50304, 2048, 24, 16, 8, 1024),
}
CPU_SHAPE = {"small": (4, 64)}  # CPU: the small model on a small batch keeps the run to minutes


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """12 parameter tensors per layer, 5 more around them."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_arm(config: str, device: str, seq: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    vocab, width, layers, heads, _, _ = CONFIGS[config]
    torch.manual_seed(0)
    model = GPT(vocab, width, layers, heads, seq).to(device)
    fused = {"fused": True} if device == "cuda" else {"foreach": True}
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, **fused)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_loop(
    config: str, device: str, bootstrap: str, blocks: int, block_steps: int, sync_check: bool
) -> dict:
    vocab = CONFIGS[config][0]
    batch, seq = CONFIGS[config][4:] if device == "cuda" else CPU_SHAPE[config]
    bare_model, bare_opt = make_arm(config, device, seq)
    model, opt = make_arm(config, device, seq)
    g = torch.Generator(device=device).manual_seed(1)
    data = [torch.randint(0, vocab, (batch, seq + 1), device=device, generator=g) for _ in range(8)]
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    with tempfile.TemporaryDirectory() as spool:
        rw = RunWatch(f"bench-watch-{config}-{free_port()}", bootstrap, spool_dir=spool)
        watch = rw.watch(model, opt, clip=1.0, heartbeat_s=5.0)

        def bare_step(i: int) -> None:
            x = data[i % len(data)]
            with autocast:
                loss = F.cross_entropy(bare_model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
            bare_opt.step()
            bare_opt.zero_grad(set_to_none=True)
            if i % 10 == 0:
                loss.item()  # a typical loop logs its loss now and then

        def watched_step(i: int) -> None:
            x = data[i % len(data)]
            with autocast:
                loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
            loss.backward()
            opt.step()  # runwatch's hooks measure and clip around it
            opt.zero_grad(set_to_none=True)
            watch.end_step(loss, tokens=batch * seq)

        for i in range(3):  # warm-up: allocator, kernels, the publisher's connection
            bare_step(i)
            watched_step(i)
        sync(device)
        times: dict[str, list[float]] = {"bare": [], "watched": []}
        sync_calls = 0
        step = 0
        for b in range(blocks):
            for arm in ("bare", "watched") if b % 2 else ("watched", "bare"):
                fn = bare_step if arm == "bare" else watched_step
                sync(device)
                t = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if sync_check and arm == "watched":
                        torch.cuda.set_sync_debug_mode("warn")
                    for i in range(block_steps):
                        fn(step + i)
                    if sync_check:
                        torch.cuda.set_sync_debug_mode(0)
                sync(device)
                times[arm].append(time.perf_counter() - t)
                if arm == "watched":
                    sync_calls += sum("synchroniz" in str(w.message) for w in caught)
            step += block_steps
        watch.close()
        stats = rw.close(timeout=30)
    bare, watched = statistics.median(times["bare"]), statistics.median(times["watched"])
    return {
        "batch": batch,
        "seq": seq,
        "blocks": blocks,
        "steps_per_block": block_steps,
        "bare_step_ms": round(bare / block_steps * 1e3, 3),
        "watched_step_ms": round(watched / block_steps * 1e3, 3),
        "ratio": round(watched / bare, 4),
        "sync_calls_in_watched_blocks": sync_calls if sync_check else None,
        "watch_errors": watch.errors,
        "published": stats.published,
        "spooled": stats.spooled,
        "dropped": stats.dropped,
    }


def params_and_tensors(config: str) -> tuple[int, int]:
    vocab, width, layers, heads, _, seq = CONFIGS[config]
    with torch.device("meta"):
        model = GPT(vocab, width, layers, heads, seq)
    tensors = list(model.parameters())
    return sum(p.numel() for p in tensors), len(tensors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--configs",
        default=None,
        help="comma-separated of small,mid,large (default: all that fit the device; CPU: small)",
    )
    ap.add_argument("--blocks", type=int, default=None, help="blocks per arm (default 10 on CUDA, 4 on CPU)")
    ap.add_argument(
        "--block-steps", type=int, default=None, help="steps per block (default 50 on CUDA, 10 on CPU)"
    )
    ap.add_argument("--host-steps", type=int, default=1000, help="steps of the host-cost part (0: skip it)")
    ap.add_argument(
        "--sync-check", action="store_true", help="CUDA: count synchronizing calls in watched blocks"
    )
    args = ap.parse_args()
    cuda = args.device == "cuda"
    configs = args.configs.split(",") if args.configs else (list(CONFIGS) if cuda else ["small"])
    blocks = args.blocks or (10 if cuda else 4)
    block_steps = args.block_steps or (50 if cuda else 10)
    result: dict = {
        "benchmark": "watch_step_overhead",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap)
        unreachable = f"127.0.0.1:{free_port()}"
        if args.host_steps:
            result["host"] = {
                "tensor_ops_per_step": count_ops(),
                "broker_reachable": measure(broker.bootstrap, steps=args.host_steps),
                "broker_unreachable": measure(unreachable, steps=args.host_steps),
            }
        result["loops"] = {}
        for config in configs:
            params, tensors = params_and_tensors(config)
            result["loops"][config] = {
                "params": params,
                "tensors": tensors,
                "broker_reachable": run_loop(
                    config, args.device, broker.bootstrap, blocks, block_steps, args.sync_check
                ),
                "broker_unreachable": run_loop(
                    config, args.device, unreachable, blocks, block_steps, args.sync_check
                ),
            }
            print(json.dumps({config: result["loops"][config]}), file=sys.stderr, flush=True)  # progress
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
