"""The MQTT topic scheme and the tierkit request parameters that ride in the Open Inference Protocol.

A device publishes escalations on `tierkit/v1/{device}/escalate` with a Response Topic inside its
own subtree (`tierkit/v1/{device}/reply`), so a broker role with the device's own literal topics lets
it touch only those: publish `escalate`, `telemetry`, `reported`; subscribe to `reply` and `desired`
(`cloud_service.identity.device_role` builds it for Mosquitto's dynamic-security plugin, which does not
substitute `%c`; never `tierkit/v1/%c/#`, which would let a device write its own desired state). Cloud
replicas share escalations through `$share/{group}/tierkit/v1/+/escalate`.
"""

from __future__ import annotations

ROOT = "tierkit/v1"

# Parameters of a ModelInferRequest that carry tierkit metadata (stock servers ignore them).
PARAM_DEVICE = "tierkit.device_id"
PARAM_BOOT = "tierkit.boot_id"
PARAM_SEQ = "tierkit.seq"
PARAM_EDGE_ANSWER = "tierkit.edge_answer"
PARAM_EDGE_SCORE = "tierkit.edge_score"
PARAM_VARIANT = "tierkit.variant"
PARAM_RELEASE = "tierkit.release"  # the release (digest) or configured model that answered
PARAM_TRACE = "tierkit.trace_id"
# Absolute deadline (Unix epoch, milliseconds): MQTT has no deadlines of its own, so a server drops
# a request that is past it before computing anything.
PARAM_DEADLINE_MS = "tierkit.deadline_ms"
# When the device sent it (Unix epoch, milliseconds): the server learns how long the broker's trip takes,
# and keeps that back from deadlines for the answer's way back.
PARAM_SENT_MS = "tierkit.sent_ms"
# Set on a response that was served from the duplicate-request cache.
PARAM_CACHED = "tierkit.cached"
# Set (true) on an audit: a confident edge answer sent to the cloud only to compare, after it was answered.
PARAM_AUDIT = "tierkit.audit"
# MQTT has no status codes: an error reply carries these two MQTT v5 user properties (and the same
# keys as string parameters of its ModelInferResponse): a gRPC status name such as "NOT_FOUND", and
# the message. A reply without them is a success.
STATUS_PROPERTY = "tierkit.status"
ERROR_PROPERTY = "tierkit.error"
# A refusal (RESOURCE_EXHAUSTED: the cloud is busy) adds when a retry is likely to find room, in
# milliseconds, as a third user property (and parameter); over gRPC the `retry-after-ms` trailer.
RETRY_AFTER_PROPERTY = "tierkit.retry_after_ms"
RETRY_AFTER_METADATA = "retry-after-ms"

_FORBIDDEN = set("/+#\x00")


def check_device_id(device: str) -> str:
    if not device or len(device) > 128 or _FORBIDDEN & set(device) or device.startswith("$"):
        msg = f"device id {device!r} must be 1-128 characters without '/', '+', '#', NUL or a leading '$'"
        raise ValueError(msg)
    return device


def escalate_topic(device: str) -> str:
    return f"{ROOT}/{check_device_id(device)}/escalate"


def reply_topic(device: str) -> str:
    return f"{ROOT}/{check_device_id(device)}/reply"


def telemetry_topic(device: str) -> str:
    return f"{ROOT}/{check_device_id(device)}/telemetry"


def desired_topic(device: str) -> str:
    return f"{ROOT}/{check_device_id(device)}/desired"


def reported_topic(device: str) -> str:
    return f"{ROOT}/{check_device_id(device)}/reported"


def shared_escalate_subscription(group: str) -> str:
    if not group or _FORBIDDEN & set(group):
        msg = f"shared subscription group {group!r} must be non-empty without '/', '+', '#'"
        raise ValueError(msg)
    return f"$share/{group}/{ROOT}/+/escalate"


def device_from_topic(topic: str) -> str:
    """The `{device}` of a `tierkit/v1/{device}/...` topic; ValueError when it is not one."""
    parts = topic.split("/")
    if len(parts) < 4 or f"{parts[0]}/{parts[1]}" != ROOT:
        msg = f"topic {topic!r} is not under {ROOT}/{{device}}/"
        raise ValueError(msg)
    return check_device_id(parts[2])
