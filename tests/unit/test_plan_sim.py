"""The pool-sizing simulator against cases with closed-form answers."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.planner.perf_model import DecodeModel, PrefillModel, StepModel, TransferModel
from tandem.planner.cpu_share import CorePlacement, Hardware, Job, nice_weight, share_cores
from tandem.planner.mix import Mix
from tandem.planner.plan_sim import Simulation
from tandem.planner.sim_worker import Engine, SimRequest
from tandem.router.config import RouterConfig

KV_BYTES = 1000  # per token


def steps(prefill_s: float = 0.1, per_token: float = 0.0, decode_base: float = 0.02, per_seq: float = 0.0,
          per_ctx: float = 0.0) -> StepModel:
    return StepModel(PrefillModel(prefill_s, per_token, 0.0), DecodeModel(decode_base, per_seq, per_ctx))


def simulation(requests, *, prefill=1, decode=1, colocated=False, model=None, cores=8.0, budget=2048,
               transfer=TransferModel(0.005, 1e-6), threads=1, prefill_nice=0, step_s_per_token=0.0,
               conditional=False, local_prefill=None, router=None, bursts=None, **hw) -> Simulation:
    return Simulation(requests, mix=Mix(prefill, decode, colocated, conditional), steps=model or steps(),
                      transfer=transfer, engine=Engine(budget, 256, 16, 100_000, KV_BYTES),
                      hardware=Hardware(cores, threads, prefill_nice, step_s_per_token=step_s_per_token, **hw),
                      router=router, local_prefill=local_prefill, bursts=bursts)


def simulate(requests, **kw):
    return simulation(requests, **kw).run().records


def req(t: float, prompt_len: int, out: int, i: int = 0) -> SimRequest:
    return SimRequest(t, tuple(range(i * 7, i * 7 + prompt_len)), out)


def test_single_prefill_worker_is_an_md1_queue():
    # One prompt per step (budget = prompt length), deterministic service D, Poisson arrivals:
    # mean time in system D + rho*D / (2(1 - rho)) (Pollaczek-Khinchine).
    d, rate, n = 0.1, 5.0, 20_000
    arrivals = np.cumsum(np.random.default_rng(1).exponential(1 / rate, n))
    recs = simulate([req(float(t), 16, 1, i) for i, t in enumerate(arrivals)], model=steps(prefill_s=d), budget=16)
    rho = rate * d
    expected = d + rho * d / (2 * (1 - rho))
    ttft = np.mean([r["ttft_s"] for r in recs])
    assert all(r["ok"] and r["output_tokens"] == 1 for r in recs)
    assert ttft == pytest.approx(expected, rel=0.04)


def test_decode_batch_tpot_is_the_profiled_step_time():
    # 8 requests at once on one colocated worker: one prefill step for all, then every
    # decode step has the whole batch, so TPOT is decode(8) exactly.
    model = steps(prefill_s=0.3, decode_base=0.01, per_seq=0.002)
    recs = simulate([req(0.0, 32, 20, i) for i in range(8)], decode=1, colocated=True, model=model)
    for r in recs:
        assert r["ttft_s"] == pytest.approx(0.3)
        assert r["tpot_s"] == pytest.approx(0.01 + 8 * 0.002)
        assert r["output_tokens"] == 20


def test_a_served_step_is_longer_by_its_per_token_cost():
    # as above, each step also pays the served cost of every token it emits: the prefill
    # step 8 first tokens, each decode step 8 tokens
    model = steps(prefill_s=0.3, decode_base=0.01, per_seq=0.002)
    recs = simulate([req(0.0, 32, 20, i) for i in range(8)], decode=1, colocated=True, model=model,
                    step_s_per_token=0.001)
    for r in recs:
        assert r["ttft_s"] == pytest.approx(0.3 + 8 * 0.001)
        assert r["tpot_s"] == pytest.approx(0.01 + 8 * 0.002 + 8 * 0.001)


def test_served_step_factors_scale_the_prompt_and_the_decode_part():
    # as above, a served prompt step costing 1.5x the profiled one and a decode step 2x;
    # the run accounts each role's steps and their cost
    model = steps(prefill_s=0.3, decode_base=0.01, per_seq=0.002)
    sim = Simulation([req(0.0, 32, 20, i) for i in range(8)], mix=Mix(0, 1, colocated=True), steps=model,
                     transfer=None, engine=Engine(2048, 256, 16, 100_000, KV_BYTES),
                     hardware=Hardware(8.0, 1, prefill_step_factor=1.5, decode_step_factor=2.0))
    res = sim.run()
    decode = 2.0 * (0.01 + 8 * 0.002)
    for r in res.records:
        assert r["ttft_s"] == pytest.approx(1.5 * 0.3)
        assert r["tpot_s"] == pytest.approx(decode)
    n, prompt, decodes = res.engine["both"]
    assert n == 20 and prompt == pytest.approx(1.5 * 0.3)
    assert decodes == pytest.approx(19 * decode)  # the prompts' step decodes nothing



def test_one_disaggregated_request_adds_the_transfer_before_token_two():
    model = steps(prefill_s=0.2, decode_base=0.02, per_ctx=1e-5)
    transfer = TransferModel(0.004, 1 / 2e6)
    prompt, out = 100, 5
    (r,) = simulate([req(1.0, prompt, out)], model=model, transfer=transfer)
    xfer = 0.004 + prompt * KV_BYTES / 2e6
    # decode step k attends the prompt plus the tokens so far: context prompt + k
    decode = sum(0.02 + 1e-5 * (prompt + k) for k in range(1, out))
    assert r["ttft_s"] == pytest.approx(0.2)
    assert r["e2e_s"] == pytest.approx(0.2 + xfer + decode)
    assert r["itl_s"][0] == pytest.approx(xfer + 0.02 + 1e-5 * (prompt + 1))


def test_a_prompt_waits_for_its_decode_workers_step_to_reserve_blocks():
    # A's decode steps run 0.121-0.171, 0.171-0.221, ... (prefill 0.1, transfer 0.021): B,
    # sent at 0.19, reaches its prefill worker when the step in progress ends at 0.221
    model = steps(prefill_s=0.1, decode_base=0.05)
    a, b = simulate([req(0.0, 16, 50, 0), req(0.19, 16, 2, 1)], model=model)
    assert a["ttft_s"] == pytest.approx(0.1)
    assert b["ttft_s"] == pytest.approx(0.221 + 0.1 - 0.19)


def test_a_worker_computing_a_long_prompt_looks_as_full_as_the_engine_has_it():
    # colocated: A decodes a stream, B takes a 1,024-token prompt (1.07 s); a short prompt
    # sent meanwhile goes to A, because B's engine holds the blocks of the chunk it computes
    model = steps(prefill_s=0.05, per_token=0.001, decode_base=0.02)
    _, _, short = simulate([req(0.0, 16, 200, 0), req(0.01, 1024, 2, 1), req(0.5, 16, 2, 2)], decode=2,
                           colocated=True, model=model)
    assert short["ttft_s"] < 0.1


def test_chunked_prefill_splits_a_prompt_across_steps():
    # budget 100: a 250-token prompt takes 3 steps of 100, 100, 50 tokens (per_token cost only)
    model = steps(prefill_s=0.0, per_token=0.001)
    (r,) = simulate([req(0.0, 250, 1)], decode=1, colocated=True, model=model, budget=100)
    assert r["ttft_s"] == pytest.approx(0.25)


def test_workers_sharing_a_core_run_at_half_speed():
    # Two colocated workers, one request each at t=0: on 2 cores each prefill takes D, on
    # one core both take 2D (processor sharing).
    two = [req(0.0, 16, 1, 0), req(0.0, 16, 1, 1)]
    fast = simulate(two, decode=2, colocated=True, model=steps(prefill_s=0.1), cores=2)
    slow = simulate(two, decode=2, colocated=True, model=steps(prefill_s=0.1), cores=1)
    assert [r["ttft_s"] for r in fast] == pytest.approx([0.1, 0.1])
    assert [r["ttft_s"] for r in slow] == pytest.approx([0.2, 0.2])


def test_three_workers_on_two_cores_run_as_two_sharing_one():
    # placed (as Linux does): the prompt alone on its core finishes after D, the two sharing
    # the other have done D/2 each by then and take a core each: done at 1.5D; fluid: all
    # three at 2/3 speed, done at 1.5D
    three = [req(0.0, 16, 1, i) for i in range(3)]
    placed = simulate(three, decode=3, colocated=True, model=steps(prefill_s=0.1), cores=2)
    fluid = simulate(three, decode=3, colocated=True, model=steps(prefill_s=0.1), cores=2, whole_cores=False)
    assert sorted(r["ttft_s"] for r in placed) == pytest.approx([0.1, 0.15, 0.15])
    assert [r["ttft_s"] for r in fluid] == pytest.approx([0.15, 0.15, 0.15])


def test_core_placement_shares_a_core_then_rebalances():
    cpu = CorePlacement(2, seed=3)
    a, b, c, bg = Job(1, 1.0), Job(1, 1.0), Job(1, 1.0), Job(0, 1.0)
    cpu.share([a, b, c], bg)
    assert sorted([a.rate, b.rate, c.rate]) == pytest.approx([0.5, 0.5, 1.0])
    alone = next(j for j in (a, b, c) if j.rate == 1.0)
    alone.threads = 0  # the one alone goes idle: the two sharing spread over both cores
    cpu.share([a, b, c], bg)
    assert sorted([a.rate, b.rate, c.rate]) == pytest.approx([0.0, 1.0, 1.0])
    wide = Job(2, 1.0)  # a job of two threads (one per core) runs at its slowest thread's share
    cpu.share([a, b, c, wide], bg)
    assert wide.rate == pytest.approx(0.5)
    for j in (a, b, c):
        j.threads = 0
    bg.threads = 1.0  # a background of one core is half of each core: a lone thread gets 2/3 of its core
    cpu.share([a, b, c, wide], bg)
    assert wide.rate == pytest.approx(2 / 3)
    assert bg.rate == pytest.approx(2 / 3)  # of the one core it wants: a third of each core
    one = CorePlacement(1)
    two_threads = Job(2, 1.0)  # more threads than cores: both run on the one core
    one.share([two_threads], Job(0, 1.0))
    assert two_threads.rate == pytest.approx(0.5)


def test_the_request_path_takes_a_free_core_first_then_shares_the_busy_ones():
    cpu = CorePlacement(2)
    worker, path, bg = Job(1, 1.0), Job(1, 1.0), Job(0, 1.0)
    cpu.share([worker], bg, path)  # one core free: the path runs there, the worker keeps its own
    assert (worker.rate, path.rate) == pytest.approx((1.0, 1.0))
    other = Job(1, 1.0)
    cpu.share([worker, other], bg, path)  # both cores held: half a thread's worth on each
    assert (worker.rate, other.rate) == pytest.approx((2 / 3, 2 / 3))
    assert path.rate == pytest.approx(2 / 3)  # a third of each core
    bg.threads = 1.0
    cpu.share([worker], bg, path)  # half of the free core each; their other halves share the worker's
    assert (worker.rate, path.rate, bg.rate) == pytest.approx((0.5, 0.75, 0.75))


def test_a_workers_steps_waiting_for_the_request_path_join_one_feed_item():
    # 50 ms of path CPU per feed item against 10 ms steps: the first token's item runs 0.30
    # to 0.35 s; steps 2-5 end meanwhile and wait as one item (the feed batches what is
    # pending), delivered at 0.40 s, not one item each (0.55 s)
    model = steps(prefill_s=0.3, decode_base=0.01)
    recs = simulate([req(0.0, 32, 5)], decode=1, colocated=True, model=model, frontend_s_per_token=0.0,
                    frontend_s_per_step=0.05)
    assert recs[0]["ttft_s"] == pytest.approx(0.35)
    assert recs[0]["e2e_s"] == pytest.approx(0.40)
    assert recs[0]["output_tokens"] == 5


def test_tokens_reach_the_client_through_the_request_path():
    # 8 first tokens of one prefill step pass the frontend in one item (8 x 1 ms of its CPU),
    # every request 5 ms later than sent; later steps' tokens queue behind earlier ones
    model = steps(prefill_s=0.3, decode_base=0.01)
    recs = simulate([req(0.0, 32, 3, i) for i in range(8)], decode=1, colocated=True, model=model,
                    frontend_s_per_token=0.001, request_latency_s=0.005)
    for r in recs:
        assert r["ttft_s"] == pytest.approx(0.005 + 0.3 + 0.008)
        assert r["e2e_s"] == pytest.approx(0.005 + 0.3 + 2 * 0.01 + 0.008)  # the path keeps up
        assert r["output_tokens"] == 3
    slow_path = simulate([req(0.0, 32, 3, i) for i in range(8)], decode=1, colocated=True, model=model,
                         frontend_s_per_token=0.002)
    # 16 ms per item against a 10 ms step: the third item waits for the second, which waited
    # for the first
    assert slow_path[0]["e2e_s"] == pytest.approx(0.3 + 3 * 0.016)
    # a cost per step's item as well: 4 ms + 8 x 1 ms for the first tokens
    per_step = simulate([req(0.0, 32, 3, i) for i in range(8)], decode=1, colocated=True, model=model,
                        frontend_s_per_token=0.001, frontend_s_per_step=0.004)
    assert per_step[0]["ttft_s"] == pytest.approx(0.3 + 0.004 + 0.008)


def test_share_cores_caps_threads_and_weighs_niceness():
    a, b = Job(1, 1.0), Job(1, 1.0)
    share_cores([a, b], 4)
    assert (a.rate, b.rate) == (1.0, 1.0)  # never above one core per thread
    share_cores([a, b], 1)
    assert (a.rate, b.rate) == pytest.approx((0.5, 0.5))
    nice = Job(1, nice_weight(10))
    share_cores([a, nice], 1)
    assert a.rate == pytest.approx(1 / (1 + 1.25 ** -10))
    assert a.rate + nice.rate == pytest.approx(1.0)
    idle = Job(0, 1.0)
    share_cores([a, idle], 1)
    assert (a.rate, idle.rate) == (1.0, 0.0)


def test_router_spreads_prompts_over_prefill_workers():
    # Two prefill workers, two simultaneous prompts: the real router sends the second
    # to the worker with the smaller backlog, so both finish after one prefill.
    recs = simulate([req(0.0, 64, 1, 0), req(0.0, 64, 1, 1)], prefill=2, decode=1, model=steps(prefill_s=0.1))
    assert [r["ttft_s"] for r in recs] == pytest.approx([0.1, 0.1])
    one = simulate([req(0.0, 64, 1, 0), req(0.0, 64, 1, 1)], prefill=1, decode=1, model=steps(prefill_s=0.1),
                   budget=64)
    assert sorted(r["ttft_s"] for r in one) == pytest.approx([0.1, 0.2])


def test_conditional_prefills_short_prompts_on_the_decode_worker():
    # A 1,024-token prompt occupies the one prefill worker for 1.074 s; a 16-token prompt
    # sent at 0.1 s waits behind it when disaggregated, and under the router's threshold it
    # prefills at once on the idle decode worker when conditional, at that worker's own cost
    pool = steps(prefill_s=0.05, per_token=0.001)
    local = PrefillModel(0.03, 0.0, 0.0)
    reqs = [req(0.0, 1024, 2, 0), req(0.1, 16, 2, 1)]
    long_d, short_d = simulate(reqs, model=pool, local_prefill=local)
    sim = simulation(reqs, model=pool, conditional=True, local_prefill=local)
    res = sim.run()
    long_c, short_c = res.records
    assert long_c["ttft_s"] == long_d["ttft_s"] == pytest.approx(1.074)
    assert short_d["ttft_s"] == pytest.approx(1.074 + 0.066 - 0.1)  # after the long one, at the pool's cost
    assert short_c["ttft_s"] == pytest.approx(0.03)
    assert res.engine["prefill"][0] == 1  # the prefill worker saw the long prompt only
    assert res.engine["decode"][1] == pytest.approx(0.03)  # the short one's prompt part, on the decode worker
    assert sim.router.config.mode == "conditional"


@pytest.mark.parametrize("bound_s, local", [(1.0, True), (2.0, False)])
def test_conditional_prefills_locally_while_the_prefill_worker_is_a_bound_behind(bound_s, local):
    # Each 1,024-token prompt takes the prefill worker 1.074 s (953 tok/s as it measures
    # it). #0 goes there before any rate is known, #1 to the idle worker; #2 arrives while
    # #1's 1,024 tokens are queued there: 1.074 s of wait, over a 1 s bound, under 2 s.
    pool = steps(prefill_s=0.05, per_token=0.001)
    reqs = [req(0.0, 1024, 2, 0), req(1.2, 1024, 2, 1), req(1.3, 1024, 2, 2)]
    sim = simulation(reqs, model=pool, conditional=True, local_prefill=PrefillModel(0.5, 0.0, 0.0),
                     router=RouterConfig(prefill_saturation_s=bound_s))
    third = sim.run().records[2]
    decisions = sim.router.decisions
    assert decisions["local_prefill_saturated"] == int(local)
    assert decisions["remote"] == 3 - int(local)
    assert third["ttft_s"] == pytest.approx(0.5 if local else 1.2 + 2 * 1.074 - 1.3)


def test_pools_burst_while_the_other_pool_leaves_them_its_cores():
    # 1P+1D on 2 cores, bursting to 2 threads at half the prompt cost, 0.6x the decode step.
    # A alone: its prompt at the burst cost (nothing decodes), its decode steps too (no
    # prefill pending). B arrives while A decodes: B's prompt at the 1-thread cost, A's steps
    # at the 1-thread cost while B's KV is on its way, bursting again once it arrived.
    normal, burst = steps(prefill_s=0.2, decode_base=0.02), steps(prefill_s=0.1, decode_base=0.012)
    sim = simulation([req(0.0, 16, 60, 0), req(0.5, 16, 2, 1)], cores=2.0, model=normal,
                     bursts=(burst, burst), decode_burst_threads=2, prefill_burst_threads=2)
    res = sim.run()
    a, b = res.records
    assert a["ttft_s"] == pytest.approx(0.1)
    # the steps' CPU, as a served engine counts it (its OpenMP helpers included): A's prompt
    # on two threads, B's on one
    assert res.engine["prefill"][1] == pytest.approx(2 * 0.1 + 0.2)
    kv_a = 0.1 + 0.005 + 16 * KV_BYTES * 1e-6  # A's KV lands; its steps start then
    step_at_b = kv_a + (0.5 - kv_a) // 0.012 * 0.012  # the step B's reservation waits for
    assert b["ttft_s"] == pytest.approx(step_at_b + 0.012 + 0.2 - 0.5)
    assert a["itl_s"][0] == pytest.approx(kv_a + 0.012 - 0.1)  # token 2 after the transfer
    gaps = sorted(set(round(x, 6) for x in a["itl_s"][1:]))
    assert gaps == [0.012, 0.02]  # bursting, but not while B's prompt is computed
    # a colocated worker never bursts
    colo = simulation([req(0.0, 16, 3, 0)], cores=2.0, colocated=True, model=normal, bursts=(burst, burst),
                      decode_burst_threads=2, prefill_burst_threads=2).run().records[0]
    assert colo["ttft_s"] == pytest.approx(0.2) and colo["tpot_s"] == pytest.approx(0.02)


def test_a_mix_needs_its_workers():
    with pytest.raises(ValueError, match="prefill worker"):
        Simulation([], mix=Mix(0, 1), steps=steps(), transfer=TransferModel(0, 1),
                   engine=Engine(), hardware=Hardware(2))
    with pytest.raises(ValueError, match="transfer"):
        Simulation([], mix=Mix(1, 1), steps=steps(), transfer=None,
                   engine=Engine(), hardware=Hardware(2))
    with pytest.raises(ValueError, match="not both"):
        Simulation([], mix=Mix(0, 2, colocated=True, conditional=True), steps=steps(), transfer=None,
                   engine=Engine(), hardware=Hardware(2))


def test_the_simulated_worker_batches_by_the_engines_rule(monkeypatch):
    # One worker, 16 tokens a step: a long decode, then a 63-token prompt arriving while it
    # runs. The engine serves decodes before prompt chunks, so the decode keeps a token in
    # every step and the prompt takes five steps (15 tokens each); served prompts first (the
    # rule changed in tandem.engine.batching), its later chunks take whole steps (four in
    # all) while the decode waits, and the plan's prediction moves with the rule.
    from tandem.engine import batching

    def run():
        recs = simulate([req(0.0, 16, 40, 0), req(0.25, 63, 2, 1)], decode=1, colocated=True, budget=16,
                        model=steps(prefill_s=0.05, decode_base=0.01))
        return {r["prompt_tokens"]: r for r in recs}

    engines = run()
    monkeypatch.setattr(batching, "running_order", lambda running, uncomputed:
                        sorted(running, key=lambda s: uncomputed(s) == 1))
    prompts_first = run()
    assert prompts_first[16]["tpot_s"] != engines[16]["tpot_s"]
    assert prompts_first[63]["ttft_s"] < engines[63]["ttft_s"]
