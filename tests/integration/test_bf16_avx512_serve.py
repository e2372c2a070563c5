"""bf16 on a CPU with AVX-512 BF16 but without AMX, served for real: ``tandem serve --dtype
bfloat16`` in every mode, its workers run as on such a CPU (``TANDEM_CPU_FLAGS_OFF`` hides
AMX from the server's processes, Ray's workers included), answers seeded samples through the
openai SDK with the offline engine's tokens and logprobs, run the same way here."""

from __future__ import annotations

import random

import pytest

from tandem.bench.launcher import TandemServer
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.engine.kernels import bf16_avx512_linear
from tandem.engine.kernels.onednn import BF16_AVX512
from tests.cpu_class import hidden_cpu_flags

pytestmark = pytest.mark.skipif(bf16_avx512_linear.load() is None, reason="no AVX-512 BF16 on this machine")

HIDDEN = "amx_bf16,amx_tile,amx_int8"
LENGTHS = [3, 17, 40, 90]  # conditional mode prefills those under 20 tokens on the decode worker
LOCAL_BELOW = 20
SEED, MAX_TOKENS = 7, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from tandem.engine.default_model import write_model

    return str(write_model("small", tmp_path_factory.mktemp("small") / "model"))  # heads of 32


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, 1000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def offline(model, prompts):
    """Each prompt's (text, logprobs) from the offline engine, as on a CPU without AMX."""
    with hidden_cpu_flags(*HIDDEN.split(",")):
        llm = LLM(model, dtype="bfloat16")
        assert llm.engine.runner.model.layers[0].qkv_proj.layout == BF16_AVX512
        outs = [llm.generate([p], _params(i))[0].outputs[0] for i, p in enumerate(prompts)]
    return [(o.text, [step.logprob for step in o.logprobs]) for o in outs]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=SEED + i, max_tokens=MAX_TOKENS,
                          ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("mode", ["disaggregated", "conditional", "colocated"])
def test_served_bf16_on_avx512_is_the_offline_engines(model, prompts, offline, mode):
    import openai

    server = TandemServer(model, mode=mode, served_model_name="small", startup_timeout_s=300,
                          extra_args=["--dtype", "bfloat16", "--local-prefill-threshold", str(LOCAL_BELOW)])
    with hidden_cpu_flags(*HIDDEN.split(",")):  # in the environment the server's processes inherit
        server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        for i, (prompt, (text, logprobs)) in enumerate(zip(prompts, offline)):
            reply = client.completions.create(model="small", prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0.8, top_p=0.9, seed=SEED + i, logprobs=2,
                                              extra_body={"ignore_eos": True})
            choice = reply.choices[0]
            assert (choice.text, list(choice.logprobs.token_logprobs)) == (text, logprobs), (mode, len(prompt))
    finally:
        server.stop()
