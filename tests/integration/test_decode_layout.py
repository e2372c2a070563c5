"""Each pool on its own weight layout in a real disaggregated cluster: the prefill worker
on oneDNN's blocked weights (the faster for prompts, its default), the decode worker on
packed ones (the default) or plain ones (--decode-weight-layout plain), both running
their steps through the native decode stack; every output is still the offline engine's."""

from __future__ import annotations

import pytest
import ray

from tandem.cluster.cluster import Cluster
from tandem.engine.kernels import packed_linear
from tests.integration.test_cluster import _config, prompts, reference, run_all, wait_all_free  # noqa: F401


def _layouts(actor) -> tuple[set[str], bool]:
    """(the projections' layouts, the decode stack built) on a worker's engine."""
    def probe(worker):
        from tandem.engine.kernels.onednn import CpuLinear

        model = worker.engine.runner.model
        layers = [m for m in model.layers.modules() if isinstance(m, CpuLinear)]
        return {m.layout for m in layers}, model.decode_stack is not None
    return ray.get(actor.__ray_call__.remote(probe), timeout=60)


pytestmark = pytest.mark.skipif(packed_linear.load() is None,
                                reason="no AVX-512 or AVX2 + FMA: weights asked to be packed take oneDNN's layout")


# (mode, prefill pool's layout, decode pool's): None is the default (blocked, packed)
@pytest.mark.parametrize("mode,prefill_layout,decode_layout", [
    ("disaggregated", None, None), ("disaggregated", None, "plain"), ("disaggregated", "packed", None),
    ("conditional", None, "plain")])
def test_each_pool_runs_its_own_layout_with_the_same_outputs(ray_session, checkpoint, prompts,  # noqa: F811
                                                             reference, mode, prefill_layout,  # noqa: F811
                                                             decode_layout):
    # conditional: the shorter prompts prefill on the decode worker, on its own weights
    pools = {"decode_weight_layout": decode_layout}
    if prefill_layout is not None:
        pools["prefill_weight_layout"] = prefill_layout
    cluster = Cluster(_config(checkpoint, mode=mode, prefill_workers=1, decode_workers=1, **pools)).start()
    prefill_layout, decode_layout = prefill_layout or "blocked", decode_layout or "packed"
    try:
        # the stack is built wherever the weights allow it (a prefill worker never uses it)
        assert _layouts(cluster.prefill[0].actor) == ({prefill_layout}, prefill_layout != "blocked")
        assert _layouts(cluster.decode[0].actor) == ({decode_layout}, True)
        assert cluster.engine_config("decode-0").cpu_weight_layout == decode_layout
        assert cluster.engine_config("prefill-0").cpu_weight_layout == prefill_layout
        assert run_all(cluster, prompts) == reference
        wait_all_free(cluster)
    finally:
        cluster.shutdown()


def test_colocated_workers_keep_the_clusters_layout(ray_session, checkpoint, prompts, reference):  # noqa: F811
    cluster = Cluster(_config(checkpoint, mode="colocated", prefill_workers=0, decode_workers=1,
                              prefill_weight_layout="plain", decode_weight_layout="plain")).start()
    try:
        assert _layouts(cluster.decode[0].actor) == ({"packed"}, True)  # it prefills every prompt
        assert run_all(cluster, prompts) == reference
    finally:
        cluster.shutdown()
