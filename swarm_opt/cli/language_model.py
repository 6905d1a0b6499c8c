"""The built-in language-model tasks ``lm-tiny`` ... ``lm-large``: a GPT-style byte-level decoder trained on the
Python standard library's own sources, which every machine with Python has (no download).

The corpus is the standard library directory's top-level ``*.py`` files (``sysconfig.get_paths()["stdlib"]``),
sorted by name: every 12th file is held out for evaluation, the others are cut into shards by file (file ``i`` of
the training files belongs to shard ``i % count``), and a peer reads only its shard's files. Different Python
versions ship different sources, so the corpus's identity (the Python version, and the names and sizes of its files)
joins the recipe's fingerprint: peers on another Python minor version are told so and kept apart.

The recipe: AdamW (weight decay on matrices only), linear warmup then cosine decay over global epochs, gradient
clipping at 1.0, bf16 autocast, perplexity on a fixed held-out slice.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from swarm_opt.errors import ConfigError
from swarm_opt.recipe import DataShard, Evaluation, Recipe, perplexity

HELD_OUT_EVERY = 12  # every 12th file of the corpus is held out for evaluation
VOCAB = 256  # bytes

#: name -> (layers, embedding width, heads, context length); parameters: about 0.8M, 4.8M, 25M and 100M
SIZES: Dict[str, Tuple[int, int, int, int]] = {
    "tiny": (4, 128, 4, 64),
    "small": (6, 256, 8, 128),
    "medium": (8, 512, 8, 256),
    "large": (14, 768, 12, 256),
}
#: name -> (peak learning rate, batch size, target batch size) defaults, in sequences
TRAINING: Dict[str, Tuple[float, int, int]] = {
    "tiny": (1e-3, 16, 64),
    "small": (1e-3, 16, 128),
    "medium": (6e-4, 8, 256),
    "large": (3e-4, 4, 256),
}
WARMUP_EPOCHS, DECAY_EPOCHS, FLOOR = 10, 2000, 0.1
#: the held-out windows of an evaluation, and the share of a peer's compute that evaluating may take: a forward pass
#: over a window costs about a third of a training window's forward and backward
EVAL_WINDOWS, EVAL_SHARE = 512, 0.1


def eval_every(target: int, windows: int = EVAL_WINDOWS, share: float = EVAL_SHARE) -> int:
    """Global epochs between two evaluations, so that evaluating ``windows`` windows takes at most ``share`` of what
    training ``target`` windows per epoch takes (every epoch, the 100M model's evaluation would cost two thirds of
    its training, and a peer evaluating for minutes is a peer missing the swarm's rounds)."""
    return max(1, math.ceil(windows / (3 * share * target)))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer over bytes (nanoGPT's shape: pre-norm blocks, tied input and output embeddings)."""

    def __init__(self, layers: int, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tokens.weight.T  # logits (batch, time, 256)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def corpus_files() -> List[Path]:
    """The corpus: the standard library's top-level ``*.py`` files, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if len(files) < 2 * HELD_OUT_EVERY:
        raise ConfigError(f"the language-model task reads the Python standard library's sources in {stdlib}, and "
                          f"found {len(files)} .py files there: run it with a full Python installation")
    return files


def corpus_id(files: List[Path]) -> str:
    """The corpus's identity without reading it: the Python version and the files' names and sizes."""
    listing = ";".join(f"{f.name}:{f.stat().st_size}" for f in files)
    return (f"python{sys.version_info[0]}.{sys.version_info[1]}-stdlib, {len(files)} files, "
            f"{hashlib.sha256(listing.encode()).hexdigest()[:12]}")


class HeldOut(Dataset):
    """A fixed slice of the held-out files: ``windows`` windows of ``context`` bytes at evenly spaced offsets across
    all of them (a loss on one file alone would follow that file's quirks)."""

    def __init__(self, files: List[Path], context: int, windows: int = EVAL_WINDOWS) -> None:
        text = b"\n".join(f.read_bytes() for f in files)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        starts = torch.linspace(0, len(data) - context - 2, windows).long()
        self.x = torch.stack([data[i:i + context] for i in starts.tolist()])
        self.y = torch.stack([data[i + 1:i + context + 1] for i in starts.tolist()])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ShardStream:
    """``Recipe(train_data=...)``: random windows of ``context`` bytes from one shard's files, forever."""

    def __init__(self, files: List[Path], context: int) -> None:
        self.files, self.context = files, context

    def __call__(self, shard: DataShard) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        mine = self.files[shard.index::shard.count]
        if not mine:
            raise ConfigError(f"shard {shard} of the language-model corpus is empty: it has {len(self.files)} "
                              f"training files; use a --shard count of at most {len(self.files)}")
        return self._windows(b"\n".join(f.read_bytes() for f in mine), shard.seed)

    def _windows(self, text: bytes, seed: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        rng = random.Random(seed)
        while True:
            start = rng.randrange(len(data) - self.context - 1)
            window = data[start:start + self.context + 1]
            yield window[:-1], window[1:]


def warmup_cosine(warmup: int, decay: int, floor: float):
    """The learning-rate factor at a global epoch: linear warmup over ``warmup`` epochs, then cosine decay to
    ``floor`` over ``decay`` epochs."""
    def factor(epoch: int) -> float:
        if epoch < warmup:
            return (epoch + 1) / warmup
        progress = min(1.0, (epoch - warmup) / max(1, decay - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def decay_groups(model: nn.Module, weight_decay: float = 0.1) -> List[Dict[str, Any]]:
    """Weight decay on matrices only (not on biases, norms)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]


def language_model(size: str = "tiny") -> Recipe:
    """The recipe of ``--task lm-SIZE``."""
    layers, width, heads, context = SIZES[size]
    lr, batch_size, target = TRAINING[size]
    files = corpus_files()
    held_out = files[::HELD_OUT_EVERY]
    training = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    return Recipe(
        model=GPT(layers, width, heads, context),
        loss_fn=lm_loss,
        train_data=ShardStream(training, context),
        num_shards=16,
        param_groups=decay_groups,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95)),
        schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(WARMUP_EPOCHS, DECAY_EPOCHS,
                                                                                   FLOOR)),
        clip_grad_norm=1.0,
        precision="bf16",
        evaluation=Evaluation(HeldOut(held_out, context), batch_size=64, every_epochs=eval_every(target),
                              metric=perplexity),
        batch_size=batch_size,
        target_batch_size=target,
        data_id=corpus_id(files),
    )


def _sized(size: str):
    def task() -> Recipe:
        return language_model(size)
    task.__name__ = task.__qualname__ = f"lm_{size}"
    task.__doc__ = f"A GPT-style byte-level decoder ({size}) on the Python standard library's sources."
    return task


TASKS = {f"lm-{size}": _sized(size) for size in SIZES}
