"""What ``rw.watch(..., activations=True)`` adds to a watched loop (issue 37). Prints JSON; not in the suite.

The GPT-style models of ``bench_watch_overhead.py`` (``small``; ``mid`` on CUDA), trained by three watched
arms that differ only in the activation probe: off, every 5 steps (the default ``activations_every``) and
every step. The watcher publishes into a stub (no broker: the probe's cost is on the device and in the
hooks, not in delivery). Steps are timed in blocks with one device sync at each end, the arms alternating;
the ratio is of the median block times against the arm without the probe. With ``--sync-check`` (CUDA)
the probed blocks run under ``torch.cuda.set_sync_debug_mode("warn")`` and synchronizing calls are counted.

    .venv/bin/python tests/benchmarks/bench_activation_probe.py
    python tests/benchmarks/bench_activation_probe.py --device cuda --configs small,mid --sync-check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_watch_overhead import CONFIGS, CPU_SHAPE, make_arm, sync

from runwatch.producer.instrument.watch import Watcher

ARMS = {"off": None, "every_5": 5, "every_1": 1}


class _Stub:
    """Takes the step events and drops them."""

    def step(self, step: int, **fields: object) -> bool:
        return True


def run(config: str, device: str, blocks: int, block_steps: int, sync_check: bool) -> dict:
    vocab = CONFIGS[config][0]
    batch, seq = CONFIGS[config][4:] if device == "cuda" else CPU_SHAPE[config]
    arms = {}
    for name, every in ARMS.items():
        model, opt = make_arm(config, device, seq)
        watch = Watcher(
            _Stub(),  # type: ignore[arg-type]
            model,
            opt,
            clip=1.0,
            heartbeat_s=None,
            activations=every is not None,
            activations_every=every or 5,
        )
        arms[name] = (model, opt, watch)
    g = torch.Generator(device=device).manual_seed(1)
    data = [torch.randint(0, vocab, (batch, seq + 1), device=device, generator=g) for _ in range(8)]
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step(name: str, i: int) -> None:
        model, opt, watch = arms[name]
        x = data[i % len(data)]
        with autocast:
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.end_step(loss, tokens=batch * seq)

    for i in range(5):
        for name in arms:
            step(name, i)
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in arms}
    sync_calls = 0
    n = 5
    for b in range(blocks):
        order = list(arms) if b % 2 else list(reversed(arms))
        for name in order:
            sync(device)
            t = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if sync_check and name != "off":
                    torch.cuda.set_sync_debug_mode("warn")
                for i in range(block_steps):
                    step(name, n + i)
                if sync_check:
                    torch.cuda.set_sync_debug_mode(0)
            sync(device)
            times[name].append(time.perf_counter() - t)
            if name != "off":
                sync_calls += sum("synchroniz" in str(w.message) for w in caught)
        n += block_steps
    modules = len(arms["every_1"][2]._activations.names)  # type: ignore[union-attr]
    for _, _, watch in arms.values():
        watch.close()
    off = statistics.median(times["off"])
    return {
        "batch": batch,
        "seq": seq,
        "hooked_modules": modules,
        "step_ms": {name: round(statistics.median(t) / block_steps * 1e3, 3) for name, t in times.items()},
        "ratio_to_off": {name: round(statistics.median(t) / off, 4) for name, t in times.items()},
        "sync_calls_in_probed_blocks": sync_calls if sync_check else None,
        "watch_errors": sum(w.errors for _, _, w in arms.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--configs", default=None, help="small,mid (default: small; CUDA both)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per arm (default 10 on CUDA, 6 on CPU)")
    ap.add_argument("--block-steps", type=int, default=None, help="steps per block (default 50 CUDA, 10 CPU)")
    ap.add_argument("--sync-check", action="store_true", help="CUDA: count synchronizing calls")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    configs = args.configs.split(",") if args.configs else (["small", "mid"] if cuda else ["small"])
    blocks = args.blocks or (10 if cuda else 6)
    block_steps = args.block_steps or (50 if cuda else 10)
    result: dict = {
        "benchmark": "activation_probe",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "configs": {c: run(c, args.device, blocks, block_steps, args.sync_check) for c in configs},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
