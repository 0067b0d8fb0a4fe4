"""compile_model on the digits CNN: the ladder, its packages, its index and the recommendation rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from compilers import PruneConfig, VariantSet, compile_model
from compilers.fidelity import nll
from testkit import zoo
from testkit.rungs import ort_target, static_rung


def test_ladder_keeps_fp32_and_both_int8_quantizers(digits_ladder: VariantSet) -> None:
    ids = {e.id for e in digits_ladder}
    assert {"fp32-ort", "fp32-ov", "int8-ort-static", "int8-ov"} <= ids
    skipped = {r["id"]: r for r in digits_ladder.rejected}
    assert skipped["int8-ort-dynamic"]["stage"] == "skipped"  # a CNN has no MatMul to quantize dynamically
    for entry in digits_ladder:
        assert entry.fidelity["drop_points"] <= 1.0, entry
        assert entry.fidelity["samples"] == 359
        assert 0.97 < entry.fidelity["accuracy"] <= 1.0


def test_index_is_ordered_by_cost_and_reloads(digits_ladder: VariantSet) -> None:
    loaded = VariantSet.load(digits_ladder.directory)
    costs = [e.cost_ms for e in loaded]
    assert costs == sorted(costs)
    assert [e.id for e in loaded] == [e.id for e in digits_ladder]


def test_exactly_one_recommended_never_slower_than_fp32(digits_ladder: VariantSet) -> None:
    recommended = [e for e in digits_ladder if e.recommended]
    assert len(recommended) == 1
    default = digits_ladder.build["default_batch"]
    assert default == 1
    baseline = digits_ladder.build["baseline_latency_ms"][f"batch_{default}"]["p50"]
    assert recommended[0].latency_ms[f"batch_{default}"]["p50"] <= baseline
    fastest = min(digits_ladder, key=lambda e: e.latency_ms["batch_1"]["p50"])
    if fastest.latency_ms["batch_1"]["p50"] <= baseline:
        assert recommended[0].id == fastest.id


def test_packages_verify_with_the_signing_key(digits_ladder: VariantSet, sign_key: Ed25519PrivateKey) -> None:
    for entry in digits_ladder:
        pkg = digits_ladder.open(entry.id, trusted_keys=[sign_key.public_key()])
        assert pkg.signed_by
        m = pkg.manifest
        assert (m.precision, m.runtime, m.target) == (entry.precision, entry.runtime, "x86-avx512")
        assert m.size_bytes == entry.size_bytes > 0
        assert set(m.latency_ms) >= {"batch_1", "batch_64", "host", "threads"}
        assert m.latency_ms["batch_64"]["p95"] >= m.latency_ms["batch_64"]["p50"] > 0
        assert m.energy["label"].startswith("modeled:")
        assert m.energy["mj"] > 0
        assert m.build["data"]["calibration"]["samples"] == 300
        assert m.build["tools"]["onnxruntime"]
        assert m.reference_sha256
        assert len(m.reference_sha256) == 64


def test_manifest_carries_classifier_calibration(digits_ladder: VariantSet, digits: zoo.Split) -> None:
    pkg = digits_ladder.open("int8-ort-static")
    cal = pkg.manifest.calibration
    assert cal["temperature"] > 0
    assert set(cal["ood"]) == {"energy_mean", "energy_std", "energy_p01", "energy_p99"}
    assert cal["ood"]["energy_p01"] <= cal["ood"]["energy_mean"] <= cal["ood"]["energy_p99"]
    curve = cal["escalation_curve"]
    assert {"threshold", "escalation_rate", "accuracy_accepted", "coverage"} <= set(curve[0])
    rates = [p["escalation_rate"] for p in curve]
    assert rates == sorted(rates)  # higher threshold, more escalation
    with np.load(pkg.directory / cal["validation_file"]) as val:
        assert val["logits"].shape == val["reference_logits"].shape == (len(digits.y_val), 10)
        np.testing.assert_array_equal(val["labels"], digits.y_val)
        assert nll(val["logits"], val["labels"], cal["temperature"]) <= nll(val["logits"], val["labels"]) + 1e-9


def test_int8_passes_are_recorded_for_reproduction(digits_ladder: VariantSet) -> None:
    passes = digits_ladder.open("int8-ort-static").manifest.passes
    q = next(p for p in passes if p["name"] == "quantize_ort")
    assert (q["mode"], q["per_channel"], q["method"]) == ("static", True, "minmax")
    assert (q["preprocess"], q["activation_type"]) == ("full", "uint8")  # u8s8: what x86 VNNI kernels take
    nncf = next(p for p in digits_ladder.open("int8-ov").manifest.passes if p["name"] == "quantize_nncf")
    assert nncf["fake_quantize_ops"] > 0
    assert nncf["nncf"]


def test_static_int8_quantizes_every_conv_weight_after_preprocessing(digits: zoo.Split, tmp_path: Path) -> None:
    """The torch export folds BatchNorm into Conv and shares equal folded biases through Identity
    nodes; quantized as exported, such a Conv keeps an fp32 bias and onnxruntime cannot fuse it into
    an int8 convolution. Pre-processing removes the aliases: every Conv reads an int8 weight and an
    int32 bias, each through a DequantizeLinear."""
    import onnx
    import torch

    from compilers.passes import export

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, 3, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10)).eval()
    raw, _ = export.to_onnx(net, {"x": torch.from_numpy(digits.x_test[:1])}, tmp_path / "convbn.onnx")
    assert any(n.op_type == "Identity" for n in onnx.load(str(raw)).graph.node)  # what the exporter does
    vs = compile_model(raw, output=tmp_path / "out", target=ort_target(static_rung()), precisions=("int8",),
                       calibration={"x": digits.x_train[:64]}, validation={"x": digits.x_val[:64]},
                       max_drop=100.0, progress=False)
    graph = onnx.load(str(vs.open("int8-ort-static").artifact_path)).graph
    producers = {o: n for n in graph.node for o in n.output}
    initializers = {i.name: i.data_type for i in graph.initializer}
    convs = [n for n in graph.node if n.op_type == "Conv"]
    assert len(convs) == 2
    for conv in convs:
        for index, dtype in ((1, onnx.TensorProto.INT8), (2, onnx.TensorProto.INT32)):
            dq = producers[conv.input[index]]
            assert dq.op_type == "DequantizeLinear", (conv.name, index)
            assert initializers[dq.input[0]] == dtype, (conv.name, index)


def test_preprocessing_falls_back_to_the_raw_model(tmp_path: Path) -> None:
    from compilers.passes.quantize_ort import _preprocess

    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    model, how = _preprocess(broken, tmp_path / "pre" / "model.onnx")
    assert model == broken
    assert how.startswith("none: ")


def test_recommended_package_runs_through_runtimes(digits_ladder: VariantSet, digits: zoo.Split,
                                                   digits_cnn_reference: np.ndarray) -> None:
    pkg = digits_ladder.open()
    with pkg.open_session() as session:
        logits = session.run({"x": digits.x_test})["logits"]
    agree = (logits.argmax(1) == digits_cnn_reference.argmax(1)).mean()
    assert agree >= 0.99


def test_report_table_lists_kept_and_skipped(digits_ladder: VariantSet) -> None:
    from compilers.report import format_table

    rows = digits_ladder.build["report"]
    assert {r["status"] for r in rows} >= {"recommended", "kept", "skipped"}
    fp32 = next(r for r in rows if r["id"] == digits_ladder.build["baseline"])
    assert fp32["speedup_vs_fp32"]["batch_1"] == pytest.approx(1.0)
    table = format_table(rows, (1, 64))
    assert "x fp32 b64" in table
    assert "int8-ort-dynamic: no MatMul" in table


def test_prune_and_distillation_recover_within_the_limit(digits_cnn, digits: zoo.Split,  # type: ignore[no-untyped-def]
                                                         digits_validation: dict[str, np.ndarray],
                                                         tmp_path: Path) -> None:
    vs = compile_model(digits_cnn, example_inputs=digits.x_train[:1], output=tmp_path / "pruned",
                       target=ort_target(), precisions=("fp32",), prune=PruneConfig(0.5, epochs=60),
                       calibration={"x": digits.x_train}, validation=digits_validation, max_drop=1.0,
                       progress=False)
    entry = vs.entry("pruned50-fp32-ort")
    assert entry.fidelity["drop_points"] <= 1.0
    record = next(p for p in vs.open(entry.id).manifest.passes if p["name"] == "prune")
    assert record["params_after"] < 0.5 * record["params_before"]
    assert record["macs_after"] < 0.5 * record["macs_before"]
    assert record["recovery"]["method"] == "distillation"
    assert record["agreement_after_recovery"] > record["agreement_before_recovery"]
    assert record["agreement_after_recovery"] >= 0.97


def test_torch_module_and_export_program_compile(digits_cnn, digits: zoo.Split,  # type: ignore[no-untyped-def]
                                                 digits_validation: dict[str, np.ndarray], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    program = torch.export.export(digits_cnn, (torch.from_numpy(digits.x_train[:1]),))
    vs = compile_model(program, output=tmp_path / "pt2", target="torch", precisions=("fp32",),
                       calibration={"x": digits.x_train[:200]}, validation=digits_validation, progress=False)
    pkg = vs.open("fp32-torch")
    assert pkg.manifest.artifact == "model.pt2"
    assert pkg.manifest.inputs[0].shape[0] == 1
    assert vs.entry("fp32-torch").fidelity["top1_agreement"] == 1.0


def test_recompiling_into_a_variant_set_replaces_it(digits_cnn_onnx: Path, digits_calibration: dict[str, np.ndarray],
                                                    digits_validation: dict[str, np.ndarray], tmp_path: Path) -> None:
    out = tmp_path / "again"
    first = compile_model(digits_cnn_onnx, output=out, target="x86-avx2", precisions=("fp32",),
                          calibration=digits_calibration, validation=digits_validation, progress=False)
    assert (out / "fp32-ov").is_dir()
    second = compile_model(digits_cnn_onnx, output=out, target=ort_target(), precisions=("fp32",),
                           calibration=digits_calibration, validation=digits_validation, progress=False)
    assert [e.id for e in first] != [e.id for e in second] == ["fp32-ort"]
    assert not (out / "fp32-ov").exists()
    assert [e.id for e in VariantSet.load(out)] == ["fp32-ort"]


def test_prune_with_a_user_training_loop(digits_cnn, digits: zoo.Split,  # type: ignore[no-untyped-def]
                                         digits_validation: dict[str, np.ndarray], tmp_path: Path) -> None:
    calls = []

    def finetune(module):  # type: ignore[no-untyped-def]
        calls.append(sum(p.numel() for p in module.parameters()))
        return zoo.train(module, digits, epochs=3, seed=1)

    vs = compile_model(digits_cnn, example_inputs=digits.x_train[:1], output=tmp_path / "ft", target=ort_target(),
                       precisions=("fp32",), prune=PruneConfig(0.5, finetune=finetune),
                       calibration={"x": digits.x_train[:300]}, validation=digits_validation, max_drop=2.0,
                       progress=False)
    assert len(calls) == 1
    record = next(p for p in vs.open("pruned50-fp32-ort").manifest.passes if p["name"] == "prune")
    assert record["recovery"] == {"method": "user-finetune"}
    assert record["finetune"].endswith("finetune")
    assert calls[0] == record["params_after"]


def test_one_energy_profile_per_machine(digits_ladder: VariantSet) -> None:
    """The manifest's modeled energy and the agent's (hence its controller's) carry the probe's one label."""
    from edge_agent.options import AgentOptions
    from runtimes.hardware import machine_power_profile, probe

    label = f"modeled:{probe(openvino=False).power_profile}"
    assert machine_power_profile().label == label
    assert AgentOptions().power.label == label
    assert {e.energy["label"] for e in digits_ladder} == {label}
    assert digits_ladder.open().manifest.energy["label"] == label
