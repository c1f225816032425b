"""The scenario catalog: data describing each scenario, its fault a configured injector (:mod:`.faults`).

The recorded scenarios (``recorded=True``) make the labelled corpus of ``runwatch scenarios generate``;
every scenario, recorded or not, can be run live by ``runwatch demo --scenario NAME``. The demo's own
three (``healthy``, ``nan``, ``grad-spike``) train the small regressor of :mod:`runwatch.demo.training`
on the wall clock, with checkpoints on disk.
"""

from __future__ import annotations

from runwatch.detectors import registry
from runwatch.producer.instrument.gradstats import ROOT_MODULE
from runwatch.scenarios.faults import (
    BadInit,
    CategoryDivergence,
    DataWait,
    GradNormSpike,
    Healthy,
    LossSpike,
    MemoryFragmentation,
    MemoryLeak,
    ModuleGradExplosion,
    NonFinite,
    Overfitting,
    Stall,
    ThroughputDrift,
    UpdateRatio,
)
from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.variants import HARDER_VARIANTS

AUDIO_JOB = "scenarios/audio"  # bad_init_audio and its correctly initialised twins: one job, one history

# Which detector each fault kind is for: what every detector declares
# (detectors/runwatch/detectors/registry.py).
DETECTOR_FOR = registry.detector_for_fault()
FAULT_TYPES = ("healthy", *DETECTOR_FOR)


CATALOG: tuple[Scenario, ...] = (
    # ---- the demo's small regressor: wall clock, checkpoints on disk, its fault step chosen by the demo ----
    Scenario("healthy", Healthy(), "regressor", "The demo's small regressor, no fault.", recorded=False),
    Scenario(
        "nan",
        NonFinite("weights", float("nan")),
        "regressor",
        "A weight turns NaN at the fault step (a corrupt update no gradient shows, which the step "
        "guard cannot skip): every later step is NaN; the default policy rolls back.",
        recorded=False,
    ),
    Scenario(
        "grad-spike",
        GradNormSpike("scaled_inputs", 200.0),
        "regressor",
        "One corrupted batch x200 out of "
        "range at the fault step: activations, gradients and the loss blow up for one step.",
        recorded=False,
    ),
    # ---- faults ----
    Scenario(
        "nan_loss_mlp",
        NonFinite("loss", float("nan")),
        "mlp",
        "A log(0) in a custom loss term makes the loss NaN at the onset; "
        "the NaN gradients poison the weights and every later step is NaN.",
        onset=0.55,
    ),
    Scenario(
        "inf_input_transformer",
        NonFinite("embeddings", 1e38),
        "transformer",
        "A corrupted batch of embeddings overflows "
        "(x1e38): the loss is inf/NaN at the onset and the weights stay non-finite afterwards.",
        onset=0.6,
        step_time_s=0.4,
        seed=1,
    ),
    Scenario(
        "loss_spike_mlp",
        LossSpike(label_shift=1),
        "mlp",
        "One batch with every label shifted by one class (a corrupted "
        "shard): the loss spikes for that step, clipping keeps the weights sane.",
        onset=0.6,
    ),
    Scenario(
        "loss_spike_cnn",
        LossSpike(label_shift=3, image_scale=30.0),
        "cnn",
        "One batch of images with inverted, x30 brightness and wrong labels: a loss spike for one step.",
        onset=0.5,
        seed=2,
        step_time_s=0.3,
    ),
    Scenario(
        "grad_spike_mlp",
        GradNormSpike("sample_sum", 64.0),
        "mlp",
        "One step back-propagates the summed instead of the mean "
        "loss (a reduction bug): the gradient norm jumps by the batch size for that step, the logged loss "
        "is normal.",
        onset=0.55,
        seed=3,
    ),
    Scenario(
        "grad_spike_transformer",
        GradNormSpike("element_sum", 512.0),
        "transformer",
        "One step back-propagates the loss summed "
        "over all tokens (x batch*length): a gradient-norm spike, normal loss.",
        onset=0.5,
        seed=4,
        step_time_s=0.4,
    ),
    Scenario(
        "module_explosion_mlp",
        ModuleGradExplosion("encoder.2", growth=1.15),
        "mlp",
        "From the onset the gradient of encoder.2 "
        "grows by x1.15 per step (a hook multiplying it, as an unstable layer would), up to x1e4; the other "
        "modules stay normal.",
        onset=0.5,
        seed=5,
    ),
    Scenario(
        "module_explosion_transformer",
        ModuleGradExplosion("encoder.self_attn.out_proj", growth=1.25),
        "transformer",
        "From the onset the gradient of encoder.self_attn.out_proj grows by x1.25 per step up to x1e4.",
        onset=0.5,
        seed=6,
        step_time_s=0.4,
    ),
    Scenario(
        "bad_init_audio",
        BadInit(ROOT_MODULE),
        "audio",
        "The field-notes mistake: a bare "
        "nn.Parameter(torch.randn(n_mels)) multiplied onto log-mel frames in dB. Present from step 0, owned "
        "by the root module ('(root)'): its gradient carries the dB magnitude (tens to hundreds of times the "
        "additive fix's, whose zero bias the correctly initialised twins keep on the root too), yet it is "
        "not the largest module (conv1 is). No per-run detector can see it; compared with the twins, the "
        "job's earlier runs (same baseline key, started before it), the root's norm is far above theirs.",
        onset=0.0,
        lr=1e-3,
        batch=16,
        step_time_s=0.3,
        baseline_key=AUDIO_JOB,
    ),
    Scenario(
        "lr_too_large_mlp",
        UpdateRatio(lr_scale=100.0),
        "mlp",
        "At the onset a resumed scheduler sets the LR x100: the relative update norm jumps out of its band.",
        onset=0.5,
        seed=7,
        schedule="constant",
        lr=1e-3,
    ),
    Scenario(
        "lr_vanishing_cnn",
        UpdateRatio(lr_scale=1e-4),
        "cnn",
        "At the onset the LR collapses x1e-4 to 1e-7 (a schedule "
        "whose total steps were set too small): updates vanish, training silently stops.",
        onset=0.5,
        seed=8,
        schedule="constant",
        lr=1e-3,
        step_time_s=0.3,
    ),
    Scenario(
        "throughput_halved_cnn",
        ThroughputDrift(factor=2.0),
        "cnn",
        "From the onset every step takes twice as long "
        "(a noisy neighbour takes half the machine): throughput halves and stays there.",
        onset=0.5,
        seed=9,
        step_time_s=0.3,
    ),
    Scenario(
        "throughput_creep_transformer",
        ThroughputDrift(factor=1.8, ramp=True),
        "transformer",
        "From the onset the step time "
        "creeps up linearly to +80% by the end of the run (a growing host-side cost).",
        onset=0.4,
        seed=10,
        step_time_s=0.4,
    ),
    Scenario(
        "data_wait_growing_mlp",
        DataWait(grow_to_step_times=3.0),
        "mlp",
        "From the onset the data loader falls behind: the wait "
        "per batch grows linearly to 3x the compute time (workers dying one by one).",
        onset=0.5,
        seed=11,
        step_time_s=0.2,
    ),
    Scenario(
        "data_wait_jump_transformer",
        DataWait(jump_to_s=0.6),
        "transformer",
        "At the onset the data moves to a slow "
        "remote store: the wait per batch jumps to 0.6 s against 0.4 s of compute.",
        onset=0.55,
        seed=12,
        step_time_s=0.4,
    ),
    Scenario(
        "memory_leak_mlp",
        MemoryLeak(),
        "mlp",
        "From the onset a debugging hook keeps every step's "
        "activations in a list that is never cleared: real tensors really retained (host RSS grows), "
        "about 110 KB per step, gradual. allocated/reserved come from the documented caching-allocator "
        "model (CPU run) and grow by exactly the retained bytes.",
        onset=0.4,
        seed=13,
        steps=400,
        quick_steps=120,
    ),
    Scenario(
        "memory_fragmentation_transformer",
        MemoryFragmentation(),
        "transformer",
        "From the onset batches "
        "have a variable sequence length (16..256, padding removed). allocated/reserved are EMULATED by the "
        "documented caching-allocator model (CPU run: no CUDA allocator) from the real activation sizes: "
        "cached blocks of earlier lengths are the wrong size, so reserved - allocated grows while allocated "
        "stays level.",
        onset=0.3,
        seed=14,
        batch=16,
        step_time_s=0.4,
        steps=400,
        quick_steps=120,
    ),
    Scenario(
        "category_divergence_mlp",
        CategoryDivergence("sv", share=0.3),
        "mlp",
        "From the onset a growing share of the "
        "labels of category 'sv' (4% of the data) come from a broken pipeline (a fixed permutation of the "
        "classes), up to 30% of that category after 100 steps: its loss rises while the mean loss barely "
        "moves.",
        onset=0.5,
        seed=15,
        steps=400,
        quick_steps=300,
    ),
    Scenario(
        "category_divergence_cnn",
        CategoryDivergence("pt", share=0.6),
        "cnn",
        "From the onset a growing share (up to "
        "60% after 100 steps) of the images of source 'pt' (8% of the data) carry wrong labels (a fixed "
        "permutation): its loss rises while the mean stays close.",
        onset=0.5,
        seed=16,
        step_time_s=0.3,
        quick_steps=300,
    ),
    Scenario(
        "overfit_val_mlp",
        Overfitting(),
        "mlp",
        "Training on 192 samples with 20% label noise: the "
        "training loss keeps falling while the validation loss turns up (real overfitting). The onset is "
        "the eval step with the best validation loss.",
        seed=17,
        steps=600,
        quick_steps=300,
        eval_every=20,
        extra={"train_size": 192, "label_noise": 0.2},
        lr=5e-4,
        schedule="constant",
    ),
    Scenario(
        "stall_hang_train",
        Stall("train", seconds=180.0),
        "mlp",
        "At the onset the rank hangs in the training phase (a collective "
        "that never returns): heartbeats go on for 180 s in phase 'train', the step does not move, then the "
        "job is killed (run_end 'interrupted'). onset_step is the last completed step.",
        onset=0.7,
        seed=18,
    ),
    Scenario(
        "stall_dataload_hang",
        Stall("dataload", seconds=300.0),
        "cnn",
        "At the onset the data loader hangs for 300 s (phase "
        "'dataload', past its allowance), then recovers. onset_step is the last completed step.",
        onset=0.6,
        seed=19,
        step_time_s=0.3,
    ),
    # ---- healthy, with the benign events naive detectors mistake for faults ----
    Scenario(
        "healthy_mlp_warmup_cosine",
        Healthy(),
        "mlp",
        "Warm-up to the LR peak, cosine decay, checkpoints and evals.",
        seed=20,
        warmup=40,
        benign=("lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_mlp_planned_lr_drop",
        Healthy(),
        "mlp",
        "Constant LR with a planned x0.1 drop at 60% (the update ratio drops tenfold, by design).",
        seed=21,
        schedule="step_drop",
        lr=2e-3,
        benign=("planned_lr_drop", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_cnn_epoch_boundaries",
        Healthy(),
        "cnn",
        "Epochs of 50 steps in a fixed order whose first "
        "batches are the noisiest: the loss bumps at every epoch boundary.",
        seed=22,
        step_time_s=0.3,
        extra={"epoch": 50},
        benign=("epoch_boundary_loss_bump", "lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_transformer_long_checkpoint",
        Healthy(),
        "transformer",
        "A long checkpoint save of 240 s "
        "(phase 'checkpoint') half way: heartbeats go on, the step does not move, and that is not a stall.",
        seed=23,
        step_time_s=0.4,
        extra={"long_checkpoint_s": 240.0},
        benign=("long_checkpoint", "lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_small_batch_noisy",
        Healthy(),
        "mlp",
        "Batches of 4: a noisy, heavy-tailed loss and grad norm, no fault.",
        seed=24,
        batch=4,
        lr=5e-4,
        step_time_s=0.05,
        benign=("noisy_small_batch_loss", "lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_audio_fixed_init",
        Healthy(),
        "audio_fixed",
        "The additive fix of bad_init_audio (a "
        "zero-initialised bias on the root, added to the dB frames), same seed and schedule, a day before "
        "it: compared with the earlier twins below it must raise nothing.",
        lr=1e-3,
        batch=16,
        step_time_s=0.3,
        benign=("lr_warmup_peak", "checkpoint", "eval"),
        baseline_key=AUDIO_JOB,
        days_earlier=1.0,
    ),
    *(
        Scenario(
            f"healthy_audio_fixed_init_seed{seed}",
            Healthy(),
            "audio_fixed",
            "An earlier run of the audio "
            "job with the additive fix, another seed: history for the runs after it.",
            lr=1e-3,
            batch=16,
            step_time_s=0.3,
            seed=seed,
            benign=("lr_warmup_peak", "checkpoint", "eval"),
            baseline_key=AUDIO_JOB,
            days_earlier=1.0 + seed,
        )
        for seed in (1, 2, 3)
    ),
    Scenario(
        "healthy_frequent_evals",
        Healthy(),
        "transformer",
        "Evals every 20 steps that take 60 s each and a "
        "checkpoint every 40 steps: long off-step phases, heartbeats say 'eval'.",
        seed=25,
        step_time_s=0.4,
        eval_every=20,
        eval_s=60.0,
        checkpoint_every=40,
        benign=("periodic_eval", "checkpoint", "lr_warmup_peak"),
    ),
    Scenario(
        "healthy_data_hiccups",
        Healthy(),
        "cnn",
        "Now and then one batch waits 2-4 s (a storage hiccup, a GC pause): single slow steps, no drift.",
        seed=26,
        step_time_s=0.3,
        extra={"hiccup_every": 37},
        benign=("single_slow_steps", "lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_warm_restarts",
        Healthy(),
        "mlp",
        "Cosine annealing with warm restarts every 100 steps: the "
        "LR jumps back to its peak and the loss bumps, by design.",
        seed=27,
        schedule="warm_restarts",
        benign=("lr_restart", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_rare_category",
        Healthy(),
        "transformer",
        "Categories of very different sizes: the rarest has 4% of the data and a noisy per-step loss.",
        seed=28,
        step_time_s=0.4,
        batch=32,
        benign=("rare_category_noise", "lr_warmup_peak", "checkpoint", "eval"),
    ),
    Scenario(
        "healthy_eval_memory_step",
        Healthy(),
        "mlp",
        "An eval with a 4x larger batch under no_grad and a "
        "larger training batch after a planned batch-size increase at 50%: memory steps up once, then is "
        "flat.",
        seed=29,
        extra={"batch_increase": 2},
        benign=("memory_step_up", "lr_warmup_peak", "checkpoint", "eval"),
    ),
)

CATALOG = (*CATALOG, *HARDER_VARIANTS)  # the harder variants of issue 27, one file per shape

SCENARIOS = {s.name: s for s in CATALOG}
CORPUS: tuple[Scenario, ...] = tuple(s for s in CATALOG if s.recorded)
