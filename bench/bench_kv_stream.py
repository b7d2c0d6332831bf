"""Throughput of the KV-event stream's reader, judge and reference index.

1. Makes a stream: the reference engine (policy ``deferred``, depth 2, ``--blocks`` blocks of 16
   tokens) serves ``--requests`` shared-prefix requests and publishes its registrations in vLLM's
   wire form (``conformance/kvevents/reference.py``), one batch per step; the engine invariants are
   judged meanwhile (not timed).
2. Times, over that stream, median of ``--rounds`` interleaved rounds: msgspec decoding of the
   frames (``kv_events.decode_batch``), decoding plus the stream's judge (``kv_judge.StreamJudge``,
   every stream invariant, ``ViewWithinCapacity`` included), decoding plus the reference index
   (``router_index.RouterIndex.apply``), and lookups of every request's prompt in the final
   index. Prints events/s (and lookups/s) for each, and the judge's memory (peak of tracemalloc).

``python bench/bench_kv_stream.py [--requests 2000] [--blocks 1024] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from kvspec.conformance.kvevents.frames import decode_batch
from kvspec.conformance.kvevents.reference import ReferenceStreamAdapter
from kvspec.conformance.kvevents.router_index import RouterIndex
from kvspec.conformance.kvevents.stream_judge import StreamJudge
from kvspec.reference.choices import DefaultChoices
from kvspec.reference.workload import shared_prefix_workload
from kvspec.spec import Config


def make_stream(
    requests: int, blocks: int
) -> tuple[list[tuple[int, bytes]], list[tuple[int, ...]]]:
    config = Config(num_blocks=blocks, block_size=16, depth=2, policy="deferred", token_budget=2048, max_running=64)  # fmt: skip
    adapter = ReferenceStreamAdapter(config, DefaultChoices())
    prompts = []
    for rid, prompt, max_tokens, priority in shared_prefix_workload(requests, 8, 256, 48, 16, 0):
        adapter.add_request(rid, prompt, max_tokens, priority)
        prompts.append(prompt)
        if rid % 16 == 15:
            while adapter.step():
                pass
    while adapter.step():
        pass
    assert adapter.stream.violation is None, adapter.stream.violation
    return [(f.seq, f.payload) for f in adapter.stream.frames], prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    started = time.perf_counter()
    frames, prompts = make_stream(args.requests, args.blocks)
    batches = [decode_batch(seq, payload) for seq, payload in frames]
    events = sum(len(b.events) for b in batches)
    print(
        f"stream: {len(frames)} batches, {events} events, {sum(len(payload) for _, payload in frames)} bytes "
        f"({time.perf_counter() - started:.1f} s to make)"
    )

    def decode() -> None:
        for seq, payload in frames:
            decode_batch(seq, payload)

    def judge() -> None:
        j = StreamJudge(capacity=args.blocks - 1)
        for seq, payload in frames:
            assert j.feed(decode_batch(seq, payload)) is None, j.finding

    index = RouterIndex()

    def build() -> None:
        nonlocal index
        index = RouterIndex()
        for seq, payload in frames:
            index.apply("e", decode_batch(seq, payload))

    def lookup() -> None:
        for prompt in prompts:
            index.lookup("e", prompt)

    modes = {"decode": decode, "decode + judge": judge, "decode + index": build, "lookup": lookup}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, run in modes.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    for name, samples in times.items():
        median = statistics.median(samples)
        unit, count = ("lookups", len(prompts)) if name == "lookup" else ("events", events)
        print(f"{name:16s} {count / median:12,.0f} {unit}/s   (median of {args.rounds}: {median * 1e3:.1f} ms)")  # fmt: skip
    tracemalloc.start()
    judge()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"judge peak memory {peak / 1e6:.1f} MB (the view of at most {args.blocks - 1} blocks)")


if __name__ == "__main__":
    main()
