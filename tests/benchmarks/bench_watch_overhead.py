"""Step-time cost of ``rw.watch`` on a ~10M-parameter transformer: bare versus instrumented.

The same training loop runs twice in one process, on two identical models, with the
steps interleaved (bare, watched, bare, watched, ...) so machine noise hits both
alike; the figure is the ratio of the median step times. The bare loop clips with
``clip_grad_norm_`` as a real loop would; the watched one lets runwatch clip (per-module
norms every step, update norms every ``--update-every`` steps, heartbeat and memory
sampling on) and publishes each step to Kafka. Two cases: a reachable embedded broker,
and no broker at all. Prints JSON; not part of the test suite.

    .venv/bin/python tests/benchmarks/bench_watch_overhead.py [--steps 60] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn

from runwatch.producer import RunWatch
from runwatch.streams.local.broker import EmbeddedBroker, ensure_topics, free_port


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 2048, width: int = 256, layers: int = 12, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def make_arm(device: str, seed: int):
    torch.manual_seed(seed)
    model = TinyLM().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, optimizer


def batches(device: str, batch: int, seq: int, vocab: int = 2048, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield x[:, :-1].to(device), x[:, 1:].to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(watch, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Wrap the watcher's per-step methods to record how long each call takes."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        original = getattr(watch, name)

        def timed(*args, _original=original, _out=times[name], **kwargs):
            t = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _out.append(time.perf_counter() - t)

        setattr(watch, name, timed)
    return times


def run_case(bootstrap: str, device: str, steps: int, warmup: int, batch: int, seq: int, update_every: int,
             spool_dir: str) -> dict:
    bare_model, bare_opt = make_arm(device, 0)
    model, opt = make_arm(device, 0)
    rw = RunWatch(f"bench-watch-{free_port()}", bootstrap, spool_dir=spool_dir)
    watch = rw.watch(model, opt, clip=1.0, update_every=update_every, heartbeat_s=1.0)
    call_times = time_calls(watch, ("before_optimizer_step", "after_optimizer_step", "end_step"))
    bare_data, watched_data = batches(device, batch, seq), watch.data(batches(device, batch, seq))
    loss_fn = nn.CrossEntropyLoss()
    bare_times, watched_times = [], []

    def bare_step():
        x, y = next(bare_data)
        loss = loss_fn(bare_model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        loss.item()  # a typical loop reads its loss every step; the watched loop does it in its one copy

    def watched_step():
        x, y = next(watched_data)
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        watch.end_step(loss, samples=batch, tokens=batch * seq)

    for i in range(warmup + steps):
        for fn, out in ((bare_step, bare_times), (watched_step, watched_times)) if i % 2 else \
                ((watched_step, watched_times), (bare_step, bare_times)):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            if i >= warmup:
                out.append(time.perf_counter() - t)
    watch.close()
    stats = rw.close(timeout=20)
    bare_med, watched_med = statistics.median(bare_times), statistics.median(watched_times)
    return {
        "bare_median_ms": round(bare_med * 1e3, 3),
        "watched_median_ms": round(watched_med * 1e3, 3),
        "ratio": round(watched_med / bare_med, 4),
        # the mean includes the update-norm steps (every update_every), which the median skips
        "ratio_mean": round(statistics.fmean(watched_times) / statistics.fmean(bare_times), 4),
        "published": stats.published,
        "dropped": stats.dropped,
        "spooled": stats.spooled,
        # time inside runwatch's own calls per step (median over measured steps, ms), to tell
        # runwatch's work from contention with the publisher thread and the broker process
        "runwatch_calls_median_ms": {name: round(statistics.median(t[warmup:]) * 1e3, 3)
                                     for name, t in call_times.items() if len(t) > warmup},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60, help="measured steps per arm")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--update-every", type=int, default=10)
    args = ap.parse_args()
    # CPU: a small batch keeps the run to minutes; GPU: a batch that gives realistic kernel sizes.
    batch = args.batch or (8 if args.device == "cpu" else 64)
    seq = args.seq or (32 if args.device == "cpu" else 256)
    n_params = sum(p.numel() for p in TinyLM().parameters())
    result = {"benchmark": "watch_step_overhead", "device": args.device, "params": n_params, "batch": batch,
              "seq": seq, "steps_per_arm": args.steps, "update_every": args.update_every,
              "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as spool, EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap)
        result["broker_reachable"] = run_case(broker.bootstrap, args.device, args.steps, args.warmup, batch, seq,
                                              args.update_every, spool)
    with tempfile.TemporaryDirectory() as spool:
        result["broker_unreachable"] = run_case(f"127.0.0.1:{free_port()}", args.device, args.steps, args.warmup,
                                                batch, seq, args.update_every, spool)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
