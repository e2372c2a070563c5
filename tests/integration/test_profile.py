"""`tandem profile` on real engines in Ray actors (tiny model, a small grid)."""

from __future__ import annotations

import json

import pytest

from tandem.planner import profile as profile_mod
from tandem.planner.perf_model import DecodeModel, PrefillModel, TransferModel
from tandem.planner.step_timer import StepTimer

GRID = profile_mod.Grid(prefill_tokens=(16, 64, 256), prefill_batches=((4, 32),),
                        decode_setups=((1, 32), (4, 64), (8, 32)), mixed_setups=((4, 64, (32, 128)),),
                        transfer_mb=(0.25, 1.0))


def test_profile_measures_fits_and_round_trips(ray_session, tiny_model_dir, tmp_path):
    prof = profile_mod.measure(str(tiny_model_dir), threads=1, prefill_nice=0, repeats=2, transfer=True,
                               progress=lambda m: None, grid=GRID)
    pts = prof["points"]
    assert len(pts["prefill"]) == 2 * 4
    assert {(p["tokens"], p["seqs"]) for p in pts["prefill"]} == {(16, 1), (64, 1), (256, 1), (128, 4)}
    assert {p["batch"] for p in pts["decode"]} == {1, 4, 8}
    # the decode context is the batch's tokens: prompt + the token being computed, and grows by one per step
    assert min(p["context"] for p in pts["decode"] if p["batch"] == 4) >= 4 * 65
    assert [p["prefill_tokens"] for p in pts["mixed"]] == [32, 128]
    assert all(p["seconds"] > 0 and p["predicted_seconds"] > 0 for p in pts["mixed"])
    assert len(pts["transfer"]) == 2
    assert prof["hardware"]["cores"] >= 1 and prof["worker"]["threads_per_worker"] == 1
    assert prof["engine"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, K|V, kv heads, head dim, fp32
    pre, dec = PrefillModel.from_json(prof["fit"]["prefill"]), DecodeModel.from_json(prof["fit"]["decode"])
    tr = TransferModel.from_json(prof["fit"]["transfer"])
    assert pre(256) > 0 and dec(8, 300) > 0 and tr(2**20) > 0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    assert profile_mod.load(path)["fit"] == prof["fit"]
    # the cluster's default layouts: colocated workers' prompts (packed) timed apart from the
    # prefill pool's (blocked); their decode steps are the decode pool's
    assert prof["worker"]["weight_layouts"] == {"prefill": "blocked", "decode": "packed", "colocated": "packed"}
    assert set(pts["colocated"]) == {"prefill"} and len(pts["colocated"]["prefill"]) == 2 * 4
    assert PrefillModel.from_json(prof["fit"]["colocated"]["prefill"])(256) > 0
    assert "burst" not in pts and "burst" not in prof["fit"]  # not asked for
    # the progress bar's total: every point timed
    timed = sum(len(pts[k]) for k in ("prefill", "decode", "mixed", "transfer")) + len(pts["colocated"]["prefill"])
    assert profile_mod.planned_points(GRID, 2, decode_mixed=True, colocated_prefill=True, colocated_decode=False,
                                      burst_local_prefill=None, transfer=True) == timed


def test_each_kind_of_worker_is_timed_on_its_own_layout(ray_session, tiny_model_dir):
    grid = profile_mod.Grid(prefill_tokens=(16, 64, 128), prefill_batches=(), decode_setups=((1, 32), (4, 32), (2, 64)),
                            mixed_setups=((4, 32, (32,)),), transfer_mb=())
    layouts = {"prefill": "plain", "decode": "blocked", "colocated": "packed"}
    prof = profile_mod.measure(str(tiny_model_dir), threads=1, prefill_nice=0, repeats=1, transfer=False,
                               progress=lambda m: None, grid=grid, layouts=layouts, burst_threads=2)
    pts = prof["points"]
    assert set(pts["colocated"]) == {"prefill", "decode"}  # neither pool's layout: both grids again
    assert {p["batch"] for p in pts["colocated"]["decode"]} == {1, 2, 4}
    assert [p["prefill_tokens"] for p in pts["mixed"]] == [32]  # on the colocated worker's layout
    assert prof["worker"]["weight_layouts"] == layouts
    # bursting: the pools' grids again on two threads, the decode pool's prompts on its own layout
    burst = pts["burst"]
    assert burst["threads"] == 2 and len(burst["prefill"]) == len(burst["local_prefill"]) == 3
    assert {p["batch"] for p in burst["decode"]} == {1, 2, 4}
    assert set(prof["fit"]["burst"]) == {"threads", "prefill", "decode", "local_prefill"}
    timed = sum(len(pts[k]) for k in ("prefill", "decode", "mixed")) + \
        sum(len(v) for v in pts["colocated"].values()) + len(burst["prefill"]) + len(burst["decode"]) + \
        len(burst["local_prefill"])
    assert profile_mod.planned_points(grid, 1, decode_mixed=False, colocated_prefill=True, colocated_decode=True,
                                      burst_local_prefill=True, transfer=False) == timed


@pytest.mark.parametrize("layout", ["plain", "blocked"])
def test_a_step_timer_runs_the_layout_it_is_given(tiny_model_dir, layout):
    from tandem.engine.kernels.onednn import CpuLinear

    timer = StepTimer(str(tiny_model_dir), threads=1, niceness=0, layout=layout, blocks=64)
    model = timer.engine.runner.model
    assert {m.layout for m in model.layers.modules() if isinstance(m, CpuLinear)} == {layout}


def test_the_grids_blocks_cover_their_largest_step():
    from tandem.planner.step_timer import grid_blocks

    # 8 sequences of 1,024 prompt tokens, each growing by 4 + 3 + 0 + 2 tokens: 8 x 65 blocks of 16
    # 8 prompts of 1,024 tokens, chunked over 6 steps, each sequence growing by 6 + 1 + 3 + 0 + 2 tokens
    assert grid_blocks([2048], [], [(8, 1024)], [], repeats=3, block_size=16, budget=2048) == 8 * 65
    # a prompt of 2,048 tokens: 129 blocks, as the engine admits it (room for its first token)
    assert grid_blocks([2048], [(4, 64)], [(1, 32)], [], repeats=3, block_size=16, budget=2048) == 129
    # mixed prompts join the setup's sequences, which then grow one token more per mixed step
    assert grid_blocks([], [], [(4, 60)], [(4, 60, (100,))], repeats=1, block_size=16, budget=2048) == 4 * 5 + 7
    assert grid_blocks([16], [], [], [], repeats=1, block_size=16, budget=2048) == 33  # the 512-token warm-up
    # the default grid on a model whose 0.25 GB of KV held fewer blocks (SmolLM2-135M in fp32: 364)
    grid = profile_mod.Grid()
    assert grid_blocks(list(grid.prefill_tokens), list(grid.prefill_batches), list(grid.decode_setups),
                       list(grid.mixed_setups), 3, 16, 2048) > 364


@pytest.mark.timeout(120)
def test_a_step_timer_holds_its_grid_whatever_the_served_cache(tiny_model_dir):
    from tandem.planner.step_timer import grid_blocks
    from tandem.engine.kv_cache.paged_cache import PagedKVCache

    setups, mixed = [(8, 96), (2, 300)], [(8, 96, (64, 200))]
    blocks = grid_blocks([], [], setups, mixed, repeats=2, block_size=16, budget=2048)
    per_block = PagedKVCache.bytes_per_block(2, 16, 2, 16, __import__("torch").float32)  # the tiny preset
    served_gb = 20 * per_block / 2**30  # 20 blocks: less than one decode setup needs
    timer = StepTimer(str(tiny_model_dir), threads=1, niceness=0, kv_cache_gb=served_gb, blocks=blocks)
    assert timer.engine.block_pool.num_blocks == blocks
    assert timer.limits()["num_blocks"] == 20  # what a served worker with that cache holds, for the plan
    points, mixed_points = timer.decode(setups, mixed, repeats=2)
    assert {p["batch"] for p in points} == {8, 2} and len(mixed_points) == 2
    assert timer.engine.block_pool.num_free == blocks  # every sequence drained


@pytest.mark.timeout(120)
def test_a_step_timer_refuses_a_grid_its_cache_cannot_hold(tiny_model_dir):
    timer = StepTimer(str(tiny_model_dir), threads=1, niceness=0, blocks=30)
    with pytest.raises(ValueError, match="needs 56 KV blocks"):
        timer.decode([(8, 96)], [], repeats=2)  # 8 x 7 blocks: it used to wait for them forever
    timer = StepTimer(str(tiny_model_dir), threads=1, niceness=0, blocks=34)  # the warm-ups fit
    with pytest.raises(ValueError, match="prefill grid needs 36 KV blocks"):
        timer.prefill([64], [(4, 128)], repeats=1)  # 4 x 9 blocks would have been timed as a partial step


@pytest.mark.timeout(120)
def test_a_decode_setup_beyond_one_steps_token_budget_is_timed_whole(tiny_model_dir):
    from tandem.planner.step_timer import grid_blocks

    # 16 prompts of 1,024 tokens take 10 steps of 2,048 tokens: the first ones decode meanwhile
    # (with 4 spare tokens each they used to finish first, and the setup waited forever)
    blocks = grid_blocks([], [], [(16, 1024)], [], repeats=2, block_size=16, budget=2048)
    timer = StepTimer(str(tiny_model_dir), threads=1, niceness=0, blocks=blocks)
    points, _ = timer.decode([(16, 1024)], [], repeats=2)
    assert [p["batch"] for p in points] == [16, 16] and min(p["context"] for p in points) > 16 * 1025
