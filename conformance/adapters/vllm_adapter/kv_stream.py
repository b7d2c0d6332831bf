"""vLLM's own KV-event publisher over loopback, its stream judged against vLLM's cache.

The scheduler ``build.py`` makes publishes to vLLM's ``NullEventPublisher``
(``KVEventsConfig(publisher="null")``: events are still made, ``enable_kv_cache_events``). Here
its ``kv_event_publisher`` is replaced by one vLLM ``ZmqEventPublisher`` per process, bound to
127.0.0.1 on ports the system picks, with its replay socket; a ``watch.Subscriber`` in the
same process receives what it sends. One publisher serves the fuzzer's engines in turn (starting a
publisher thread and sockets for every example would cost more than the example), so each engine's
stream starts at the sequence number the publisher is at when the engine is built.

vLLM publishes a batch at the end of ``Scheduler.update_from_output`` (every event queued since
the last one: the stores and evictions of the steps scheduled meanwhile, and a reset's clear). So
that is the step boundary: after it, the frames received are judged, and the view must equal
``BlockPool.cached_block_hash_to_block`` (``conformance/kvevents/engine_stream.py``). The wrapped method is
the scheduler's own, on the instance, as in ``attach.py``.

``KVSPEC_VLLM_KV_STREAM=0`` turns the stream off (the adapter then behaves as before);
``KVSPEC_KV_STREAM_INVARIANTS=A,B`` judges only those stream invariants.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from vllm.distributed.kv_events import ZmqEventPublisher
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

from kvspec.conformance.kvevents.engine_stream import Cache, EngineStream, chosen_invariants
from kvspec.conformance.kvevents.watch import Loopback as SharedLoopback
from kvspec.judge.findings import Finding

from . import versions

TOPIC = "kvspec"


def enabled() -> bool:
    return os.environ.get("KVSPEC_VLLM_KV_STREAM", "1") != "0"


class Loopback(SharedLoopback):
    """vLLM's ``ZmqEventPublisher`` and a subscriber on it, one pair per process."""

    def __init__(self) -> None:
        import zmq

        publisher = ZmqEventPublisher(
            0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic=TOPIC
        )
        # ``tcp://127.0.0.1:*`` binds a port the system picks; the sockets say which.
        endpoint = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay = publisher._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        super().__init__(publisher, endpoint, replay, TOPIC)

    def close(self) -> None:
        self.subscriber.close()
        self.publisher.shutdown()


_loopback: Loopback | None = None


def loopback() -> Loopback:
    global _loopback
    if _loopback is None:
        _loopback = Loopback()
        atexit.register(_loopback.close)
    return _loopback


class _Publisher:
    """What the scheduler calls ``kv_event_publisher``: forwards to the shared vLLM publisher
    and remembers the sequence number of the last batch this engine published."""

    def __init__(self, stream: VllmKvStream) -> None:
        self.stream = stream

    def publish(self, batch: Any) -> None:
        self.stream.last_seq = self.stream.loop.publish(batch)

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self) -> Any:
        return self.stream.loop.publisher.get_publisher_config()


class VllmKvStream:
    """One engine's stream: the publisher swapped in, ``update_from_output`` wrapped."""

    def __init__(self, scheduler: Any) -> None:
        self.loop = loopback()
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.first_seq = self.loop.published
        self.last_seq = self.first_seq - 1
        self.taken = self.first_seq - 1
        self.engine = EngineStream(self.first_seq, self.pool.medium, chosen_invariants())
        scheduler.kv_event_publisher = _Publisher(self)
        update = scheduler.update_from_output

        def update_from_output_(*args: Any, **kw: Any) -> Any:
            result = update(*args, **kw)
            self.boundary()
            return result

        scheduler.update_from_output = update_from_output_

    def boundary(self) -> None:
        frames = self.loop.receive(self.last_seq) if self.last_seq > self.taken else []
        self.taken = self.last_seq
        self.engine.at_boundary(frames, self.cache())

    def cache(self) -> Cache:
        """vLLM's prefix cache as the stream names it: (group, external hash) -> block ids."""
        out: dict[tuple[int | None, Any], tuple[int, ...]] = {}
        for key, ids in versions.cached_block_ids(self.pool).items():
            name = (get_group_id(key), maybe_convert_block_hash(get_block_hash(key)))
            out[name] = out.get(name, ()) + ids
        return out

    def check(self, judge: Any) -> Finding | None:
        return self.engine.check(judge)
