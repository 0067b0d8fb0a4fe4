"""Structured channel pruning of a torch model (torch-pruning's dependency graph), then recovery.

Removing whole channels shrinks the dense kernels, which is what makes a model faster (50% of
the channels gave 2.2x on a ResNet-18-like CNN); it also drops a CNN to chance accuracy until it
is trained again. Recovery distils the unpruned model into the pruned one on the calibration
inputs, so no labels are needed: KL divergence between temperature-softened outputs for
classifiers, mean squared error for other outputs. Small Gaussian input noise stretches a small
calibration set. A user training loop (`PruneConfig.finetune`) replaces distillation.

The layers that produce the model's outputs keep their channels, so the output shape is unchanged.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import numpy as np
import torch
import torch_pruning as tp
from torch import nn

from compilers.calibration import CalibrationData
from compilers.passes.export import as_tensors
from compilers.recipes import PruneConfig
from runtimes.errors import CompileError
from runtimes.spec import Task

logger = logging.getLogger(__name__)


def _output_layers(model: nn.Module, tensors: tuple[torch.Tensor, ...]) -> list[nn.Module]:
    layers: list[nn.Module]
    """Modules whose output is a model output: the last Linear/Conv with the output's width."""
    with torch.inference_mode():
        out = model(*tensors)
    width = (out[0] if isinstance(out, tuple | list) else out).shape[1]
    layers = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)]
    hits = [m for m in layers if getattr(m, "out_features", getattr(m, "out_channels", None)) == width]
    return hits[-1:] or layers[-1:]


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _forward(model: nn.Module, batch: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    out = model(*(batch[n] for n in names))
    first: torch.Tensor = out[0] if isinstance(out, tuple | list) else out
    return first


def prune(model: nn.Module, example_inputs: Any, calibration: CalibrationData, config: PruneConfig, *,
          input_names: list[str], task: str,
          validation: CalibrationData | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Prune `config.ratio` of the channels of a copy of `model`, then recover it.

    Returns:
        The pruned, recovered module (eval mode) and the record for the manifest.
    """
    if not isinstance(model, nn.Module) or isinstance(model, torch.fx.GraphModule):
        msg = "structured pruning needs the model as a torch nn.Module (not an ONNX file or export program)"
        raise CompileError(msg)
    tensors, _ = as_tensors(example_inputs)
    teacher = copy.deepcopy(model).eval()
    student = copy.deepcopy(model).eval()
    importance = tp.importance.MagnitudeImportance(p=2) if config.importance == "magnitude" \
        else tp.importance.TaylorImportance()
    ignored = _output_layers(student, tensors)
    macs0, params0 = tp.utils.count_ops_and_params(student, tensors)
    try:
        pruner = tp.pruner.MetaPruner(student, tensors, importance=importance, pruning_ratio=config.ratio,
                                      ignored_layers=ignored)
        if config.importance == "taylor":
            _taylor_gradients(student, teacher, calibration, input_names, task)
        pruner.step()
    except Exception as exc:  # torch-pruning raises on graphs it cannot trace
        msg = f"structured pruning failed ({type(exc).__name__}: {exc}); try a lower ratio or another model"
        raise CompileError(msg) from exc
    student.zero_grad(set_to_none=True)
    macs1, params1 = tp.utils.count_ops_and_params(student, tensors)
    record: dict[str, Any] = {"name": "prune", "kind": "structured-channels", **config.to_json(),
                              "params_before": int(params0), "params_after": int(params1),
                              "macs_before": int(macs0), "macs_after": int(macs1)}
    if validation is not None:
        record["agreement_before_recovery"] = _agreement(teacher, student, validation, input_names)
    start = time.perf_counter()
    if config.finetune is not None:
        student = config.finetune(student) or student
        record["recovery"] = {"method": "user-finetune"}
    elif config.epochs:
        record["recovery"] = _distill(teacher, student, calibration, config, input_names, task)
    record["recovery_seconds"] = round(time.perf_counter() - start, 2)
    student.eval()
    if validation is not None:
        record["agreement_after_recovery"] = _agreement(teacher, student, validation, input_names)
    return student, record


def _as_torch(data: CalibrationData) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in data.inputs.items()}


def _loss(task: str, temperature: float):  # type: ignore[no-untyped-def]
    if task == Task.CLASSIFICATION:
        kl = nn.KLDivLoss(reduction="batchmean", log_target=True)

        def distill(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = kl(torch.log_softmax(s / temperature, 1), torch.log_softmax(t / temperature, 1))
            return loss * temperature**2

        return distill
    return nn.functional.mse_loss


def _distill(teacher: nn.Module, student: nn.Module, calibration: CalibrationData, config: PruneConfig,
             names: list[str], task: str) -> dict[str, Any]:
    inputs = _as_torch(calibration)
    stds = {k: float(v.float().std()) if v.is_floating_point() else 0.0 for k, v in inputs.items()}
    gen = torch.Generator().manual_seed(config.seed)
    opt = torch.optim.Adam(student.parameters(), lr=config.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, config.epochs))
    loss_fn = _loss(task, config.temperature)
    n = len(calibration)
    losses: list[float] = []
    student.train()
    deadline = time.perf_counter() + config.max_seconds
    for _ in range(config.epochs):
        if time.perf_counter() > deadline:
            logger.warning("distillation stopped at its %.0f s budget after %d epochs", config.max_seconds, len(losses))
            break
        total = 0.0
        for idx in torch.randperm(n, generator=gen).split(config.batch_size):
            batch = {}
            for k, v in inputs.items():
                x = v[idx]
                if config.noise and stds[k]:
                    x = x + torch.randn(x.shape, generator=gen) * (config.noise * stds[k])
                batch[k] = x
            with torch.no_grad():
                target = _forward(teacher, batch, names)
            opt.zero_grad()
            loss = loss_fn(_forward(student, batch, names), target)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        sched.step()
        losses.append(total / n)
    return {"method": "distillation", "epochs": len(losses), "samples": n, "loss_first": round(losses[0], 6),
            "loss_last": round(losses[-1], 6)}


def _taylor_gradients(student: nn.Module, teacher: nn.Module, calibration: CalibrationData, names: list[str],
                      task: str) -> None:
    inputs = {k: v[:256] for k, v in _as_torch(calibration).items()}
    with torch.no_grad():
        target = _forward(teacher, inputs, names)
    student.zero_grad()
    _loss(task, 1.0)(_forward(student, inputs, names), target).backward()


def _agreement(teacher: nn.Module, student: nn.Module, data: CalibrationData, names: list[str]) -> float:
    inputs = _as_torch(data)
    with torch.inference_mode():
        t, s = _forward(teacher, inputs, names), _forward(student, inputs, names)
    if t.ndim == 2:
        return round(float((t.argmax(1) == s.argmax(1)).float().mean()), 4)
    return round(float(nn.functional.cosine_similarity(t.flatten(1), s.flatten(1)).mean()), 4)
