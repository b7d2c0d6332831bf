"""vLLM-style tests with a crash planted inside kvspec, run by tests/test_pytest_plugin.py with
and without kvspec's plugin, on every supported vLLM. Each test passes without the plugin; under
it, kvspec's crash must be counted as an internal error and the test must still pass, with
vLLM's methods called exactly as often as without kvspec (counted on the class, patched before
the objects are built) and vLLM's own exceptions unchanged. And the plugin must keep no vLLM
object alive (vLLM's tests check that pools are garbage-collected).

Plants (every test runs under each, its id's parameter): ``before`` (kvspec's part of every
wrapper raises before vLLM's method runs), ``after`` (recording what vLLM did, after its method
returned), ``judge`` (the judge raises), ``attach`` (attaching raises after the wrappers are
installed), ``none`` (no crash: the tests are judged)."""

import gc
import weakref

import pytest
from case_pool import BLOCK, admit, make_manager, make_request  # the same pool set-up
from vllm.v1.core.block_pool import BlockPool

PLANTS = ("none", "before", "after", "judge", "attach")


def _boom(*args, **kwargs):
    raise RuntimeError("a crash planted in kvspec")


class _Exploding(list):
    """An attachment's event list that fails at the first event recorded after construction."""

    def append(self, event):
        raise RuntimeError("a crash planted in kvspec")


@pytest.fixture(autouse=True, params=PLANTS)
def plant(request, monkeypatch):
    """Plant the crash in kvspec's code (a no-op where kvspec's plugin is not loaded)."""
    PLANT = request.param
    if PLANT == "none":
        return
    import importlib

    from kvspec.conformance.pool_judge import PoolJudge
    from kvspec.judge.core import Judge

    attach = importlib.import_module("kvspec.conformance.adapters.vllm_adapter.attach")
    pool_attach = importlib.import_module("kvspec.conformance.adapters.vllm_adapter.pool_attach")

    if PLANT == "before":
        monkeypatch.setattr(pool_attach.PoolAttachment, "_call", _boom)
        monkeypatch.setattr(attach.Attachment, "_inner", _boom)
        monkeypatch.setattr(attach.Attachment, "_outermost", _boom)
    elif PLANT == "after":  # recording what vLLM did: after its method returned
        for cls in (pool_attach.PoolAttachment, attach.Attachment):
            made = cls.__post_init__

            def exploding(self, _made=made):
                _made(self)
                self.events = _Exploding(self.events)

            monkeypatch.setattr(cls, "__post_init__", exploding)
    elif PLANT == "judge":
        monkeypatch.setattr(PoolJudge, "feed_all", _boom)
        monkeypatch.setattr(Judge, "feed_all", _boom)
    elif PLANT == "attach":
        monkeypatch.setattr(pool_attach.PoolAttachment, "snapshot", _boom)
        monkeypatch.setattr(attach.Attachment, "fingerprint", _boom)


@pytest.fixture
def calls(monkeypatch):
    """How often vLLM's own pool methods ran, counted on the class (before any object)."""
    counts = {"get_new_blocks": 0, "free_blocks": 0, "touch": 0}
    for name in counts:
        method = getattr(BlockPool, name)

        def counting(self, *args, _method=method, _name=name, **kwargs):
            counts[_name] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(BlockPool, name, counting)
    return counts


def test_a_manager_shares_a_prefix(calls):
    manager = make_manager(num_blocks=8)
    first = make_request("first", list(range(9)))
    assert admit(manager, first) == 0
    assert calls == {"get_new_blocks": 1, "free_blocks": 0, "touch": 0}
    manager.free(first)
    second = make_request("second", list(range(8)) + [50, 51, 52])
    assert admit(manager, second) == 2 * BLOCK
    manager.free(second)
    assert calls == {"get_new_blocks": 2, "free_blocks": 2, "touch": 1}
    assert manager.block_pool.get_num_free_blocks() == 7
    assert manager.reset_prefix_cache()


def test_a_bare_pool_allocates_and_frees(calls):
    pool = BlockPool(num_gpu_blocks=6, enable_caching=True, hash_block_size=BLOCK)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 5
    assert calls == {"get_new_blocks": 1, "free_blocks": 1, "touch": 0}


def test_vllms_own_exception_is_unchanged(calls):
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=BLOCK)
    with pytest.raises(ValueError, match="Cannot get 9 free blocks from the pool"):
        pool.get_new_blocks(9)
    assert calls["get_new_blocks"] == 1
    assert pool.get_num_free_blocks() == 3


def test_a_scheduler_runs_shared_prefixes(calls):
    """A scheduler (``case_seed``'s): its requests run to the end, the cache is reset."""
    from case_seed import make_request as request_at
    from case_seed import make_scheduler, step

    scheduler = make_scheduler(policy="fcfs", num_blocks=12)
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7])):
        scheduler.add_request(request_at(f"req-{i}", prompt, priority=0, arrival=float(i)))
    steps = 0
    while scheduler.has_requests():
        step(scheduler)
        steps += 1
    assert steps == 4
    assert calls == {"get_new_blocks": 4, "free_blocks": 3, "touch": 2}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 11
    assert scheduler.kv_cache_manager.reset_prefix_cache()


def test_the_plugin_keeps_no_manager_alive():
    """A manager the test lets go is garbage-collected, with its coordinator and pool."""
    manager = make_manager(num_blocks=8)
    admit(manager, make_request("held", list(range(9))))  # a request never freed
    refs = [weakref.ref(o) for o in (manager, manager.coordinator, manager.block_pool)]
    del manager
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
