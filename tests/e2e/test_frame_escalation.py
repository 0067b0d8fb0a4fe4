"""The agent escalates the raw camera frame: `infer(frame=...)` runs the package's declared preprocessing on
the edge, sends the uint8 frame, and the real cloud service (over gRPC, and over MQTT through its bridge)
preprocesses it the same way: the same answer as escalating the fp32 input, from a quarter of the bytes.

Bytes are counted on the socket, by a byte-counting TCP proxy in front of the server or the broker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from cloud_service.config import MqttConfig, ServerConfig
from cloud_service.protocol.preprocess import Preprocess
from compilers.package import ModelPackage, write_package
from edge_agent.agent import AgentOptions, EdgeAgent
from edge_agent.budget import Budget
from edge_agent.policy import Policy
from runtimes.errors import InputError
from testkit.cloud_helpers import ServerThread
from testkit.frames import PREPROCESS, photo_frame, pool_package
from testkit.slowlink import SlowLink


def _escalate_rows(rows: list[int]) -> Policy:
    """A policy that escalates exactly the given rows of a batch (score 0 there, 1 elsewhere)."""
    def score(outputs: dict[str, np.ndarray]) -> np.ndarray:
        out = np.ones(len(outputs["y"]))
        out[[r for r in rows if r < len(out)]] = 0.0
        return out

    return Policy(score, threshold=0.5)


@pytest.fixture
def models(tmp_path: Path) -> Path:
    pool_package(tmp_path / "models" / "pool-v1")
    yield tmp_path / "models"
    shutil.rmtree(tmp_path / "models", ignore_errors=True)


@pytest.mark.parametrize("kind", ["grpc", "mqtt"])
def test_frame_escalation_answers_as_fp32_with_a_quarter_of_the_bytes(kind: str, models: Path,
                                                                       request: pytest.FixtureRequest) -> None:
    if kind == "mqtt":
        broker = request.getfixturevalue("broker")
        config = ServerConfig(models_dir=models, grpc_address=None, drain_timeout_s=2,
                              mqtt=MqttConfig(url=broker.url, client_id="cloud-frames"))
    else:
        config = ServerConfig(models_dir=models, grpc_address="127.0.0.1:0", drain_timeout_s=2)
    frame = photo_frame()  # a real 224x224 photo
    x = Preprocess.from_json(PREPROCESS).apply(frame)[0]
    package = ModelPackage.open(models / "pool-v1")
    server = ServerThread(config).start()
    try:
        host, port = ("127.0.0.1", broker.port) if kind == "mqtt" else server.grpc.rsplit(":", 1)

        async def main() -> dict[str, object]:
            async with SlowLink(host, int(port), rate_bps=1e11, rtt_s=0.0) as link:
                url = f"{kind}://127.0.0.1:{link.port}/pool"
                agent = EdgeAgent(package, cloud=url, policy=_escalate_rows([0]), budget=Budget(latency_ms=10_000),
                                  options=AgentOptions(device_id="cam-frames"))
                async with agent:
                    await agent.infer(x)  # connects; the counts below are of the escalations alone
                    sent = {}
                    answers = {}
                    for name, kwargs in (("fp32", {"x": x}), ("frame", {"frame": frame})):
                        before = link.bytes["up"]
                        answers[name] = await agent.infer(**kwargs)
                        sent[name] = link.bytes["up"] - before
                    # a batch of two frames, one of them unsure: only that frame's row is sent
                    before = link.bytes["up"]
                    answers["batch"] = await agent.infer(frame=np.stack([frame[::-1], frame]))
                    sent["batch"] = link.bytes["up"] - before
                return {"sent": sent, "answers": answers}

        result = asyncio.run(main())
    finally:
        server.stop()
    sent: dict[str, int] = result["sent"]  # type: ignore[assignment]
    answers = result["answers"]
    for pred in answers.values():  # type: ignore[attr-defined]
        assert pred.tier == "cloud"
        assert not pred.degraded
    with package.open_session() as session:
        direct = session.run({"x": x[None]})["y"][0]
    fp32 = answers["fp32"].outputs["y"]  # type: ignore[index]
    np.testing.assert_allclose(fp32, direct, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(answers["frame"].outputs["y"], fp32, rtol=0, atol=1e-6)  # type: ignore[index]
    assert 602_112 <= sent["fp32"] < 1.05 * 602_112
    assert 150_528 <= sent["frame"] < 1.05 * 150_528  # the 224x224x3 uint8 frame, plus a few hundred bytes
    assert 0.24 < sent["frame"] / sent["fp32"] < 0.26
    assert 150_528 <= sent["batch"] < 1.05 * 150_528  # one of the two frames
    batch = answers["batch"]
    assert batch.cloud_rows.tolist() == [True, False]  # type: ignore[attr-defined]
    flipped = Preprocess.from_json(PREPROCESS).apply(frame[::-1])
    with package.open_session() as session:
        np.testing.assert_allclose(batch.outputs["y"][0], session.run({"x": flipped})["y"][0],  # type: ignore[attr-defined]
                                   rtol=1e-6, atol=1e-6)


def test_frames_need_a_declared_preprocess_and_exclude_x(models: Path, tmp_path: Path) -> None:
    plain = pool_package(tmp_path / "plain")
    manifest = ModelPackage.open(plain).manifest
    write_package(plain, dataclasses.replace(manifest, preprocess={}))
    frame = photo_frame()

    async def main() -> None:
        async with EdgeAgent(ModelPackage.open(models / "pool-v1"), cloud=None) as agent:
            with pytest.raises(InputError, match="not both"):
                await agent.infer(np.zeros((3, 224, 224), np.float32), frame=frame)
            with pytest.raises(InputError, match="uint8"):
                await agent.infer(frame=frame.astype(np.float32))
            pred = await agent.infer(frame=frame)  # edge only: the preprocessed frame, without a batch axis
            assert pred.outputs["y"].shape == (3, 4, 4)
        async with EdgeAgent(ModelPackage.open(plain), cloud=None) as agent:
            with pytest.raises(InputError, match="declares no preprocess"):
                await agent.infer(frame=frame)

    asyncio.run(main())


def test_sdk_predict_sends_the_frame(models: Path) -> None:
    """`TieredModel.predict(frame=...)` and `apredict(frame=...)` escalate the frame, declared as one."""
    import sdk
    from cloud_service.protocol import decode_inputs, encode_response
    from cloud_service.protocol.encoding import PARAM_ENCODING
    from testkit.fake_transport import FakeTransport

    frame = photo_frame()

    def cloud(req: object) -> object:
        tensor = req.inputs[0]  # type: ignore[attr-defined]
        assert tensor.datatype == "UINT8"
        assert tensor.parameters[PARAM_ENCODING].string_param == "frame"
        sent = decode_inputs(req)["x"]  # type: ignore[arg-type]
        return encode_response("pool", {"y": np.full((len(sent), 3, 4, 4), 7.0, np.float32)})

    fake = FakeTransport(cloud, model="pool", device_id="cam-sdk")
    with sdk.load(models / "pool-v1", cloud=fake, policy=_escalate_rows([0]),
                  budget=sdk.Budget(latency_ms=10_000)) as model:
        pred = model.predict(frame=frame)
        assert pred.tier == "cloud"
        assert (pred.outputs["y"] == 7.0).all()
        later = asyncio.run(model.apredict(frame=frame))
        assert later.tier == "cloud"
    assert [r.inputs[0].shape for r in fake.requests] == [[1, 224, 224, 3]] * 2
