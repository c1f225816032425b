"""Harder corpus variants: memory growth (leak, fragmentation) and its benign look-alikes (CPU RSS swings
around evals).
"""

from __future__ import annotations

from runwatch.scenarios.faults import Healthy, MemoryLeak
from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = (
    Scenario(
        "memory_leak_small_mlp",
        MemoryLeak(logits_only=True),
        "mlp",
        "From the onset a metric buffer keeps every step's logits in a list that is never cleared: "
        "2.5 KB per step, a 43rd of memory_leak_mlp's leak, gradual. allocated/reserved come from the "
        "documented caching-allocator model (CPU run) and grow by exactly the retained bytes; host RSS "
        "barely moves.",
        onset=0.4,
        seed=70,
        steps=400,
        quick_steps=120,
    ),
    Scenario(
        "healthy_cpu_rss_swings_mlp",
        Healthy(),
        "mlp",
        "Host RSS swings by 150 MiB and comes back, really mapped and unmapped: after every eval 150 MiB of "
        "eval buffers stay for 12 steps; a 150 MiB data cache, filled over the first 20 steps, is dropped "
        "at every checkpoint and refilled over the next 20 steps (a steady climb back to the old level). "
        "Nothing leaks.",
        seed=71,
        steps=400,
        quick_steps=200,
        extra={"rss_swing_mib": 150},
        benign=("rss_swing", "checkpoint", "eval", "lr_warmup_peak"),
    ),
    Scenario(
        "healthy_cpu_rss_ratchet_mlp",
        Healthy(),
        "mlp",
        "Host RSS that ratchets up at the first evals, then plateaus, really mapped: evals every 25 steps "
        "on batches larger than the training ones, so each of the first 5 raises the allocator's "
        "high-water mark by 30 MiB and the allocator keeps the freed pages (the RSS steps up at the eval "
        "and stays); a 150 MiB data cache, filled over the first 40 steps, dropped at every checkpoint "
        "(every 90 steps) and refilled over the next 40 steps, so the refill after the first checkpoint, "
        "with two of those evals in it, climbs back to 60 MiB above where it was. Nothing leaks: the "
        "training steps themselves only refill the cache.",
        seed=72,
        steps=400,
        quick_steps=200,
        eval_every=25,
        checkpoint_every=90,
        extra={
            "rss_swing_mib": 150,
            "rss_swing_refill": 40,
            "rss_swing_eval_mib": 0,
            "rss_ratchet_mib": 30,
            "rss_ratchet_evals": 5,
        },
        benign=("rss_ratchet", "checkpoint", "eval", "lr_warmup_peak"),
    ),
)
