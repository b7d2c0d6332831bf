"""vLLM-style tests of a scheduler without prefix caching (vLLM's objects only, no kvspec import),
run by tests/test_pytest_plugin.py in .venv-vllm with and without kvspec's plugin. Requests share
prefixes (nothing is hit), the pool is small enough for FCFS preemption, and every table holds
several blocks, so each free is a batch. One plants a pool bug: ``free_blocks`` puts the freed
blocks at the queue's head one at a time (the table's first block ends up first) instead of as
one batch (the table's last block first)."""

from case_seed import make_request, make_scheduler, step
from vllm.v1.core.block_pool import BlockPool

PREFIX = [1, 2, 3, 4, 5]


def run_workload():
    scheduler = make_scheduler(policy="fcfs", num_blocks=10, caching=False)
    for i in range(5):
        prompt = PREFIX + [10 + i] * (i % 3 + 1)
        scheduler.add_request(make_request(f"r{i}", prompt, 0, float(i), max_tokens=4))
    steps = 0
    while scheduler.has_requests():
        output = step(scheduler)
        steps += 1
        assert not output.scheduled_new_reqs or all(
            new.num_computed_tokens == 0 for new in output.scheduled_new_reqs
        )  # nothing is ever hit
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 9 and not pool.cached_block_hash_to_block._cache
    return steps


def test_caching_off_shared_prefixes_hold():
    assert run_workload() > 5


def test_caching_off_freed_one_block_at_a_time(monkeypatch):
    def free_blocks(self, ordered_blocks):
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.prepend_n([block])

    monkeypatch.setattr(BlockPool, "free_blocks", free_blocks)
    assert run_workload() > 5
