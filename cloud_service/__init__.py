"""The cloud tier: `tierkit serve` answers the inputs edge devices escalate.

Open Inference Protocol over gRPC (`server`), the same over MQTT v5 (`mqtt_bridge`), one dynamic
batcher per model (`batcher`), hot-swappable models loaded from a directory (`repository`),
Prometheus metrics (`metrics`). `protocol/` is the published wire contract and `mqtt_client` the
one MQTT client layer: the only parts the edge agent imports. Nothing heavy is imported here:
`from cloud_service.service import CloudService`.
"""
