"""The classic mel-scale mistake, as the step events of a real ``Watcher`` show it.

The story: ``self.mel_scale = nn.Parameter(torch.randn(num_mels))`` on the root module and
``x *= self.mel_scale`` on log-mel frames in dB before the first conv of a small audio
transformer, trained with AdamW (warm-up to 1e-3) and clipping at 1.0; the fix is an additive
``LearnableBias`` initialised to zeros ("our gradient is multiplied by 1.0 instead of the input
magnitude").

What a tiny version of that model shows, and what these tests pin down:

* the bare parameter is reported under its owner, ``(root)`` (the story's per-module code
  skipped it); the fix is reported under ``mel_bias``;
* the randn scale's gradient carries the dB magnitude of the input (|x| ~ 50), the additive
  fix's does not: at every step the owner's norm is 25x to 235x the fix's (seed 0), and the
  fix's owner is the smallest module at every step while the bad owner never is;
* the owner is NOT the module with the largest norm: owner / next largest stays below 0.09
  at every step for seeds 0-4. The largest is the first conv, as the story saw ("insane by the
  frontend conv layers"), and it is the first conv with the fix too, because the dB-scale
  input, not the scale's init, makes it large. Per column i of the first layer W the scale
  gets <W[:, i], a_i> where W[:, i] gets s_i * a_i (a_i = sum over positions of x_i * dL/dh),
  so the scale only wins where W's columns align with a_i, which they do not here. Per-module
  norms count only a module's own parameters (recurse=False); recursive norms would make the
  root, which holds the scale, the largest module trivially, and the last test would fail.

A ones-initialised scale gives owner norms within 0.07x to 4.5x of randn's (seeds 0-4), so
grad norms tell multiplicative-on-dB from additive, not randn from ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runwatch.contract.schema import StepEvent
from runwatch.producer.instrument.gradstats import ROOT_MODULE
from runwatch.producer.instrument.watch import Watcher
from runwatch.scenarios.tasks import TinyAudioNet  # the corpus's bad_init_audio model
from runwatch.scenarios.threads import one_torch_thread
from tests.producer.test_instrumentation import RecordingPublisher

N_MELS, CLASSES = 40, 4  # TinyAudioNet's defaults
BATCH, FRAMES = 16, 32
STEPS, WARMUP, PEAK_LR, CLIP = 40, 10, 1e-3, 1.0


def log_mel_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames in dB, clamped to [-80, 0]: a -80..-70 floor, the class's band of bins 50 dB louder."""
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    frames = -80 + 10 * torch.rand(BATCH, FRAMES, N_MELS, generator=generator)
    band = N_MELS // CLASSES
    for k in range(CLASSES):
        rows = labels == k
        frames[rows, :, k * band : (k + 1) * band] += 50 + 10 * torch.randn(
            int(rows.sum()), FRAMES, band, generator=generator
        )
    return frames.clamp(-80, 0), labels


def train(fixed: bool, seed: int = 0, bias_on_root: bool = False) -> list[StepEvent]:
    with one_torch_thread():  # small tensors: one thread is fastest and not at the mercy of a busy machine
        torch.manual_seed(seed)
        model = TinyAudioNet(fixed, bias_on_root=bias_on_root)
        data = torch.Generator().manual_seed(seed + 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
        rw = RecordingPublisher()
        watch = Watcher(rw, model, optimizer, clip=CLIP, update_every=0, heartbeat_s=None, memory=False)
        for _ in range(STEPS):
            frames, labels = log_mel_batch(data)
            loss = F.cross_entropy(model(frames), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # the Watcher's hooks measure and clip around it
            warmup.step()
            watch.end_step(loss, samples=BATCH)
        watch.close()
        return rw.steps


@pytest.fixture(scope="module")
def runs() -> dict[str, list[StepEvent]]:
    return {"bad": train(fixed=False), "fixed": train(fixed=True)}


def test_the_bare_mel_scale_is_reported_under_its_owner_and_the_fix_under_its_module(runs):
    bad, fixed = runs["bad"], runs["fixed"]
    assert len(bad) == len(fixed) == STEPS
    modules = {
        "conv1",
        "conv2",
        "encoder.self_attn",
        "encoder.self_attn.out_proj",
        "encoder.linear1",
        "encoder.linear2",
        "encoder.norm1",
        "encoder.norm2",
        "norm",
        "head",
    }
    for event in bad:
        assert set(event.module_grad_norms) == modules | {ROOT_MODULE}
        assert event.clip_ratio is not None and event.nonfinite_grads == 0
    for event in fixed:
        assert set(event.module_grad_norms) == modules | {"mel_bias"}
    assert bad[-1].lr == [pytest.approx(PEAK_LR)]  # past the warm-up


def test_the_randn_scale_carries_the_db_magnitude_of_the_input_and_the_additive_fix_does_not(runs):
    for bad, fixed in zip(runs["bad"], runs["fixed"], strict=True):
        owner = bad.module_grad_norms[ROOT_MODULE]
        fix = fixed.module_grad_norms["mel_bias"]
        assert owner > 10 * fix, (bad.step, owner, fix)  # measured: 25x to 235x
        assert min(fixed.module_grad_norms, key=fixed.module_grad_norms.get) == "mel_bias"
        assert min(bad.module_grad_norms, key=bad.module_grad_norms.get) != ROOT_MODULE


def test_the_largest_module_is_the_first_conv_not_the_owner_of_the_scale(runs):
    for name, owner in (("bad", ROOT_MODULE), ("fixed", "mel_bias")):
        events = runs[name]
        largest = [max(e.module_grad_norms, key=e.module_grad_norms.get) for e in events]
        assert owner not in largest
        assert largest.count("conv1") > len(events) // 2, largest  # the frontend conv, as in the story
    for event in runs["bad"]:
        norms = event.module_grad_norms
        next_largest = max(v for k, v in norms.items() if k != ROOT_MODULE)
        assert norms[ROOT_MODULE] < 0.2 * next_largest  # measured: below 0.09


def test_the_twin_with_the_fix_on_the_same_owner_keeps_that_modules_norm_far_below():
    """The corpus's correctly initialised twin keeps its zero additive bias on the root (bias_on_root),
    so history compares the same module: the owner's norm stays far below the randn scale's at every
    step, and the fix is the same math as the LearnableBias (identical norms, another name)."""
    bad = train(fixed=False)
    twin = train(fixed=True, bias_on_root=True)
    fixed = train(fixed=True)
    for b, t, f in zip(bad, twin, fixed, strict=True):
        assert set(t.module_grad_norms) == set(b.module_grad_norms)
        assert b.module_grad_norms[ROOT_MODULE] > 10 * t.module_grad_norms[ROOT_MODULE], b.step
        assert t.module_grad_norms[ROOT_MODULE] == pytest.approx(f.module_grad_norms["mel_bias"], rel=1e-5)
