"""Per-version inference statistics, as Triton's statistics extension reports them (ModelStatistics).

Semantics follow Triton's, so tools written for it read them right (tritonclient's
`get_inference_statistics` is tested against it; perf_analyzer's server-side breakdown reads the same
fields but has not been run against tierkit):

- `inference_count`: rows computed (a batch of n rows counts n); `execution_count`: model runs.
- `inference_stats`, per request: `success` / `fail` (count and time from receipt to answer in the
  server), `queue` (time waiting for a model instance), `compute_infer` (the run of the batch the
  request was part of: a batch of k requests that ran t adds k requests and k*t).
- `batch_stats`, per executed batch size (rows): runs and their `compute_infer` time.

`compute_input` / `compute_output` stay zero: the batch is assembled and split inside the timed run.
A request answered before it reaches the model (wrong shape, unknown input) counts as a failure of
the version it was checked against; one for an unknown model counts nowhere (metrics have it).
"""

from __future__ import annotations

import threading
import time

from cloud_service.batcher import BatchObserver
from cloud_service.protocol import inference_pb2 as pb


class ModelStats:
    """Counters of one served version, and the batcher's observer in front of the metrics one.

    Example:
        >>> stats = ModelStats()
        >>> stats.on_batch(rows=8, requests=2, seconds=0.004, queued=0.001)
        >>> stats.request_done(0.006, ok=True)
        >>> stats.to_proto("digits", "1").execution_count
        1
    """

    def __init__(self, forward: BatchObserver | None = None) -> None:
        self._forward = forward
        self._lock = threading.Lock()
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ms = 0
        self._success = [0, 0]  # count, ns
        self._fail = [0, 0]
        self._queue = [0, 0]
        self._compute = [0, 0]
        self._batches: dict[int, list[int]] = {}  # rows -> [runs, ns]

    # -- BatchObserver, from the threads that run batches --------------------------------------

    def on_queue(self, depth: int) -> None:
        if self._forward is not None:
            self._forward.on_queue(depth)

    def on_batch(self, rows: int, requests: int, seconds: float, queued: float) -> None:
        ns = int(seconds * 1e9)
        with self._lock:
            self.inference_count += rows
            self.execution_count += 1
            self.last_inference_ms = time.time_ns() // 1_000_000
            self._queue[0] += requests
            self._queue[1] += int(queued * 1e9)
            self._compute[0] += requests
            self._compute[1] += requests * ns
            batch = self._batches.setdefault(rows, [0, 0])
            batch[0] += 1
            batch[1] += ns
        if self._forward is not None:
            self._forward.on_batch(rows, requests, seconds, queued)

    def on_expired(self, count: int) -> None:
        if self._forward is not None:
            self._forward.on_expired(count)

    def on_refused(self, reason: str) -> None:
        if self._forward is not None:
            self._forward.on_refused(reason)

    def on_queue_time(self, seconds: float) -> None:
        if self._forward is not None:
            self._forward.on_queue_time(seconds)

    # -- from the request paths -----------------------------------------------------------------

    def request_done(self, seconds: float, *, ok: bool) -> None:
        """One request answered (`ok`) or failed, `seconds` after the server received it."""
        slot = self._success if ok else self._fail
        with self._lock:
            slot[0] += 1
            slot[1] += int(seconds * 1e9)

    def to_proto(self, name: str, version: str) -> pb.ModelStatistics:
        def duration(pair: list[int]) -> pb.StatisticDuration:
            return pb.StatisticDuration(count=pair[0], ns=pair[1])

        with self._lock:
            stats = pb.ModelStatistics(
                name=name, version=version, last_inference=self.last_inference_ms,
                inference_count=self.inference_count, execution_count=self.execution_count,
                inference_stats=pb.InferStatistics(success=duration(self._success), fail=duration(self._fail),
                                                   queue=duration(self._queue),
                                                   compute_infer=duration(self._compute)))
            for rows in sorted(self._batches):
                stats.batch_stats.add(batch_size=rows, compute_infer=duration(self._batches[rows]))
        return stats
