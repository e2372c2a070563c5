"""When a prefill worker hands its layer groups to the sender: each as its last layer is
queued, so the send overlaps the next layers; while the worker bursts onto every core,
all of them after the step's last layer, so no send competes with its threads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.prefill.lifecycle import PrefillingRequest, PrefillState
from tandem.worker.threads import ElasticThreads


class RecordingSender:
    """Stands in for the KV sender: notes the layer each job was submitted at."""

    def __init__(self, worker) -> None:
        self.worker, self.layer, self.jobs = worker, -1, []

    def submit(self, job) -> None:
        self.jobs.append((self.layer, job.layer_group, job.final,
                          self.worker.requests["r"].state is PrefillState.SENDING))


@pytest.fixture
def worker(tiny_model_dir):
    from tandem.common.config import CacheConfig, EngineConfig
    from tandem.prefill.worker import PrefillWorker
    from tandem.protocol.messages import KVTransferDescriptor

    w = PrefillWorker("prefill-0", EngineConfig(model=str(tiny_model_dir),
                                                cache=CacheConfig(num_blocks=8)))
    layers = w.engine.model_config.num_layers
    assert layers >= 2
    w.requests["r"] = PrefillingRequest("r", PrefillState.PREFILLING, KVTransferDescriptor(
        request_id="r", transfer_id="r#t", block_ids=(3,),
        layer_groups=tuple((i, i + 1) for i in range(layers)), src_rank=0, dst_rank=1,
        num_prompt_tokens=4))
    w.sender = RecordingSender(w)
    yield w
    w.sender = None
    w.shutdown()


def _run_step(worker) -> list[tuple]:
    seq = SimpleNamespace(seq_id="r", block_ids=[5])
    for layer in range(worker.engine.model_config.num_layers):
        worker.sender.layer = layer
        worker._on_layer_done(layer, [seq])
    return worker.sender.jobs


def test_groups_go_out_as_their_layers_finish(worker):
    layers = worker.engine.model_config.num_layers
    assert _run_step(worker) == [(g, g, g == layers - 1, g == layers - 1)
                                 for g in range(layers)]


def test_a_bursting_worker_sends_every_group_after_the_last_layer(worker):
    worker.threads = ElasticThreads(1, 2)
    worker.threads.current = 2  # applied between steps, as the engine loop does
    assert worker.threads.bursting
    layers = worker.engine.model_config.num_layers
    # in group order; the request counts as sending from its final group on, not before
    assert _run_step(worker) == [(layers - 1, g, g == layers - 1, g == layers - 1)
                                 for g in range(layers)]


def test_at_its_base_count_an_elastic_worker_streams_layer_by_layer(worker):
    worker.threads = ElasticThreads(1, 2)
    worker.threads.current = 1
    assert not worker.threads.bursting
    assert [layer for layer, *_ in _run_step(worker)] == list(
        range(worker.engine.model_config.num_layers))


def test_the_count_at_the_first_layer_holds_for_the_whole_step(worker):
    """Were the count read at every layer, a change mid-step would skip or repeat groups."""
    worker.threads = ElasticThreads(1, 2)
    worker.threads.current = 2
    seq = SimpleNamespace(seq_id="r", block_ids=[5])
    layers = worker.engine.model_config.num_layers
    for layer in range(layers):
        worker.sender.layer = layer
        worker._on_layer_done(layer, [seq])
        worker.threads.current = 1  # from the second layer on it would read "not bursting"
    assert [group for _, group, *_ in worker.sender.jobs] == list(range(layers))
    assert {layer for layer, *_ in worker.sender.jobs} == {layers - 1}
