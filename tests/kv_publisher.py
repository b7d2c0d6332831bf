"""vLLM's ``ZmqEventPublisher`` in a process of its own, for ``tests/test_kv_watch.py``; run in
``.venv-vllm``.

``python tests/kv_publisher.py`` reads commands on stdin (``main``): ``open [FAULT]`` binds a
vLLM publisher to 127.0.0.1 (PUB and replay ROUTER on ports the system picks) and prints
``endpoint E replay R``; ``go`` drives vLLM 0.33.0's scheduler (through the vLLM adapter, its own
loopback stream off) over a fixed workload that fills, evicts and extends cached chains,
publishing what vLLM publishes, and prints ``last K`` (the last sequence number); the publisher
serves replays until ``close``. One process serves every case (vLLM is slow to import). FAULT
plants one fault in what is sent:

* ``drop-removal``: the first ``BlockRemoved`` of the stream is left out of its batch;
* ``reorder``: the first batch that stores blocks is sent after the batch that follows it;
* ``gap``: one sequence number is skipped (no batch, nothing in the replay buffer);
* ``lost-frame``: one batch is not sent on the live socket but kept for replay (a gap the
  subscriber must fill: the stream stays clean).
"""

from __future__ import annotations

import os
import sys

os.environ["KVSPEC_VLLM_KV_STREAM"] = "0"  # this script publishes itself

import zmq  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, ZmqEventPublisher  # noqa: E402

from kvspec.conformance.adapters.vllm_adapter import factory  # noqa: E402
from kvspec.spec import Config  # noqa: E402


class Ones:
    def pick(self, n: int, label: str) -> int:
        return 1


class Faulty:
    """The scheduler's ``kv_event_publisher``: vLLM's, with one fault planted."""

    def __init__(self, publisher: ZmqEventPublisher, fault: str | None) -> None:
        self.publisher, self.fault = publisher, fault
        self.published = 0
        self.held = None
        self.done = False

    def publish(self, batch: object) -> None:
        fault, events = self.fault, batch.events  # type: ignore[attr-defined]
        if fault == "drop-removal" and not self.done:
            kept = [e for e in events if not isinstance(e, BlockRemoved)]
            if len(kept) < len(events):
                first = next(i for i, e in enumerate(events) if isinstance(e, BlockRemoved))
                batch.events = events[:first] + events[first + 1 :]  # type: ignore[attr-defined]
                self.done = True
        if fault == "reorder" and not self.done:
            if self.held is None and any(isinstance(e, BlockStored) for e in events):
                self.held = batch
                return
            if self.held is not None:
                self._send(batch)
                batch, self.held, self.done = self.held, None, True
        if fault == "gap" and not self.done and self.published == 3:
            self.publisher._event_queue.join()  # every earlier batch has its number
            next(self.publisher._seq_gen)  # a sequence number with no batch behind it
            self.published += 1
            self.done = True
        if fault == "lost-frame" and not self.done and self.published == 3:
            self._send_without_pub(batch)
            self.done = True
            return
        self._send(batch)

    def _send(self, batch: object) -> None:
        self.publisher.publish(batch)  # type: ignore[arg-type]
        self.published += 1

    def _send_without_pub(self, batch: object) -> None:
        """Publish with the live socket's send dropped once (the replay buffer keeps it)."""
        self.publisher._event_queue.join()  # every earlier batch is sent
        socket = self.publisher._pub
        send = socket.send_multipart
        dropped = {"once": False}

        def send_multipart(parts: object, *args: object, **kw: object) -> None:
            if not dropped["once"]:
                dropped["once"] = True
                socket.send_multipart = send  # type: ignore[method-assign]
                return None
            return send(parts, *args, **kw)  # type: ignore[arg-type]

        socket.send_multipart = send_multipart  # type: ignore[method-assign]
        self._send(batch)

    def shutdown(self) -> None:
        pass


WORKLOAD = [  # prompts over 4 shared prefixes on 8 blocks of 2 tokens: stores, hits, evictions
    (0, (1, 2, 3, 1, 2), 4),
    (1, (1, 2, 3, 1, 3), 4),
    (2, (2, 2, 1, 1, 3), 4),
    (3, (3, 1, 3, 1, 2, 1, 2), 3),
    (4, (1, 2, 3, 1, 2, 3, 1), 4),
    (5, (2, 1, 2, 1, 2, 1), 3),
    (6, (1, 3, 1, 3, 1), 4),
    (7, (2, 2, 1, 1, 3, 3), 3),
]


def run(publisher: ZmqEventPublisher, fault: str | None) -> int:
    """The workload on a fresh vLLM scheduler; returns the last sequence number sent."""
    config = Config(
        num_blocks=8,
        block_size=2,
        policy="eager-unsafe",
        token_budget=8,
        max_running=2,
        stop_token=0,
    )
    adapter = factory(config, Ones())
    faulty = Faulty(publisher, fault)
    adapter.scheduler.kv_event_publisher = faulty
    for rid, prompt, max_tokens in WORKLOAD:
        adapter.add_request(rid, prompt, max_tokens, 0)
        for _ in range(4):
            adapter.step()
    while adapter.step():
        pass
    if adapter.reset_prefix_cache():
        adapter.add_request(99, (1, 2, 3, 1, 2), 3, 0)
        while adapter.step():
            pass
    if faulty.held is not None:
        faulty._send(faulty.held)
    return faulty.published - 1


def main() -> None:
    """Commands, one per line: ``open [FAULT]`` (a fresh publisher; prints its endpoints),
    ``go`` (the workload; prints the last sequence number), ``close``."""
    publisher, fault = None, None
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "open":
            fault = rest[0] if rest else None
            publisher = ZmqEventPublisher(
                0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"
            )
            endpoint = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            replay = publisher._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            print(f"endpoint {endpoint} replay {replay}", flush=True)
        elif command == "go" and publisher is not None:
            print(f"last {run(publisher, fault)}", flush=True)
        elif command == "close" and publisher is not None:
            publisher.shutdown()
            publisher = None
            print("closed", flush=True)


if __name__ == "__main__":
    main()
