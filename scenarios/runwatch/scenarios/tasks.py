"""The small real models and their data for recorded scenarios (a pure function of the step)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

CATEGORIES = ("en", "de", "fr", "es", "it", "pt", "nl", "sv")
CATEGORY_SHARE = (0.25, 0.2, 0.15, 0.12, 0.1, 0.08, 0.06, 0.04)


class MLP(nn.Module):
    def __init__(self, d_in: int = 40, hidden: int = 128, classes: int = 10):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.head(self.encoder(x)))


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return cast(torch.Tensor, self.head(x.mean(dim=(2, 3))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 32, max_len: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.encoder = nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return cast(torch.Tensor, self.head(self.norm(self.encoder(x, src_mask=mask, is_causal=True))))


class LearnableBias(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class TinyAudioNet(nn.Module):
    """Log-mel frames in dB -> conv frontend -> one transformer layer -> classes. ``fixed=False`` is
    the mistake from the field notes: a bare ``randn`` scale multiplied onto dB values. ``fixed=True``
    is the additive fix, a ``LearnableBias`` module (``mel_bias``); with ``bias_on_root`` the same
    zero-initialised additive bias is a bare parameter of the root module, so that the fix's per-module
    norms name the same owner (``(root)``) as the mistake's, which a comparison with history needs."""

    def __init__(
        self, fixed: bool, n_mels: int = 40, width: int = 32, classes: int = 4, bias_on_root: bool = False
    ):
        super().__init__()
        if fixed and bias_on_root:
            self.mel_offset = nn.Parameter(torch.zeros(n_mels))
        elif fixed:
            self.mel_bias = LearnableBias(n_mels)
        else:
            self.mel_scale = nn.Parameter(torch.randn(n_mels))
        self.conv1 = nn.Conv1d(n_mels, width, 3, padding=1)
        self.conv2 = nn.Conv1d(width, width, 3, stride=2, padding=1)
        self.encoder = nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "mel_offset"):
            x = x + self.mel_offset
        else:
            x = self.mel_bias(x) if hasattr(self, "mel_bias") else x * self.mel_scale
        x = F.gelu(self.conv1(x.transpose(1, 2)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        return cast(torch.Tensor, self.head(self.norm(self.encoder(x).mean(dim=1))))


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    cat: torch.Tensor  # category index per sample
    tokens: int | None = None


class Task:
    """A model, its data (a pure function of the step) and its per-sample loss."""

    names: tuple[str, ...] = CATEGORIES
    classes = 10
    tokens = False
    model: nn.Module  # set by each subclass

    def __init__(self, seed: int, batch: int):
        self.seed = seed
        self.batch = batch
        self.gen = torch.Generator().manual_seed(seed * 7919 + 1)

    def make_batch(self, step: int, size: int | None = None, length: int | None = None) -> Batch:
        raise NotImplementedError

    def per_sample_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, reduction="none")

    def validation(self, size: int) -> Batch:
        return self.make_batch(10**7, size=size)

    def categories(self, n: int, g: torch.Generator) -> torch.Tensor:
        share = torch.tensor(CATEGORY_SHARE[: len(self.names)])
        return torch.multinomial(share / share.sum(), n, replacement=True, generator=g)


class MLPTask(Task):
    def __init__(self, seed: int, batch: int, train_size: int | None = None, label_noise: float = 0.0):
        super().__init__(seed, batch)
        g = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(40, 10, generator=g)
        self.domain = 0.7 * torch.randn(len(self.names), 40, generator=g)
        self.train_size = train_size
        self.label_noise = label_noise
        self.pool = self._sample(train_size, g) if train_size else None
        self.model = MLP()

    def _sample(self, n: int, g: torch.Generator, noisy: bool = True) -> Batch:
        cat = self.categories(n, g)
        x = torch.randn(n, 40, generator=g) + self.domain[cat]
        y = (x @ self.teacher).argmax(dim=1)
        if self.label_noise and noisy:
            flip = torch.rand(n, generator=g) < self.label_noise
            y = torch.where(flip, torch.randint(0, 10, (n,), generator=g), y)
        return Batch(x, y, cat)

    def make_batch(self, step: int, size: int | None = None, length: int | None = None) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        size = size or self.batch
        if self.pool is None:
            return self._sample(size, g)
        idx = torch.randint(0, self.pool.x.shape[0], (size,), generator=g)
        if step == 10**7:  # the validation set: fresh samples from the distribution, clean labels
            return self._sample(size, g, noisy=False)
        return Batch(self.pool.x[idx], self.pool.y[idx], self.pool.cat[idx])


class CNNTask(Task):
    names = CATEGORIES[:6]
    classes = 8

    def __init__(self, seed: int, batch: int):
        super().__init__(seed, batch)
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(8, 1, 16, 16, generator=g)
        self.model = SmallCNN()

    def make_batch(self, step: int, size: int | None = None, length: int | None = None) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        size = size or self.batch
        y = torch.randint(0, 8, (size,), generator=g)
        cat = self.categories(size, g)
        noise = 0.6 + 0.25 * cat.float()  # categories differ in how noisy their images are
        x = self.patterns[y] + noise.view(-1, 1, 1, 1) * torch.randn(size, 1, 16, 16, generator=g)
        return Batch(x, y, cat)


class TransformerTask(Task):
    """Next-token prediction; each category's sequences follow their own rule ``t' = (a t + b) mod 32``."""

    names = CATEGORIES[:6]
    classes = 32
    tokens = True

    def __init__(self, seed: int, batch: int, length: int = 32):
        super().__init__(seed, batch)
        self.length = length
        self.model = TinyTransformer()

    def make_batch(self, step: int, size: int | None = None, length: int | None = None) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        size, length = size or self.batch, length or self.length
        cat = self.categories(size, g)
        a, b = (2 * cat + 3).view(-1, 1), (5 * cat + 1).view(-1, 1)
        seq = torch.empty(size, length + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, 32, (size,), generator=g)
        for i in range(length):
            seq[:, i + 1] = (a[:, 0] * seq[:, i] + b[:, 0]) % 32
        noise = torch.rand(size, length + 1, generator=g) < 0.05
        seq = torch.where(noise, torch.randint(0, 32, seq.shape, generator=g), seq)
        return Batch(seq[:, :-1], seq[:, 1:], cat, tokens=size * length)

    def per_sample_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(dim=1)


class AudioTask(Task):
    names = ("speech", "music", "noise", "silence")
    classes = 4

    def __init__(self, seed: int, batch: int, fixed: bool, bias_on_root: bool = False):
        super().__init__(seed, batch)
        self.model = TinyAudioNet(fixed, bias_on_root=bias_on_root)

    def make_batch(self, step: int, size: int | None = None, length: int | None = None) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        size = size or self.batch
        labels = torch.randint(0, 4, (size,), generator=g)
        frames = -80 + 10 * torch.rand(size, 32, 40, generator=g)
        band = 10
        for k in range(4):
            rows = labels == k
            frames[rows, :, k * band : (k + 1) * band] += 50 + 10 * torch.randn(
                int(rows.sum()), 32, band, generator=g
            )
        return Batch(frames.clamp(-80, 0), labels, labels)


class TaskShape(Protocol):
    """What ``make_task`` reads of a scenario (``scenario.Scenario`` has it): the tasks know nothing else of
    scenarios, which hold the fault injectors that corrupt the tasks' batches."""

    @property
    def model(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def extra(self) -> Mapping[str, Any]: ...


def make_task(sc: TaskShape) -> Task:
    torch.manual_seed(sc.seed)
    if sc.model == "mlp":
        return MLPTask(
            sc.seed,
            sc.batch,
            train_size=sc.extra.get("train_size"),
            label_noise=sc.extra.get("label_noise", 0.0),
        )
    if sc.model == "cnn":
        return CNNTask(sc.seed, sc.batch)
    if sc.model == "transformer":
        return TransformerTask(sc.seed, sc.batch)
    if sc.model in ("audio", "audio_fixed"):
        # the corpus's fix keeps its bias on the root, the owner of the mistake's scale (a twin for history)
        return AudioTask(sc.seed, sc.batch, fixed=sc.model == "audio_fixed", bias_on_root=True)
    raise ValueError(f"unknown model {sc.model!r}")
