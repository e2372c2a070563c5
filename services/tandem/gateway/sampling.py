"""Request fields to :class:`SamplingParams`, with the context-length rules."""

from __future__ import annotations

from tandem.common.sampling_params import SamplingParams, choice_seed
from tandem.gateway.errors import bad_request
from tandem.gateway.schemas import SamplingFields

_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs",
           "logit_bias")


def check_common(req: SamplingFields, *, max_n: int, vocab_size: int, max_model_len: int) -> int:
    """The bounds that depend on the server and the model (the schema's ``x-limit`` ones;
    prompt + output against the context needs the prompt: :func:`max_tokens_for`); return ``n``."""
    if getattr(req, "max_completion_tokens", None) is not None and req.max_tokens is not None \
            and req.max_tokens >= max_model_len:  # unused (chat prefers max_completion_tokens), still bounded
        raise bad_request(f"max_tokens must be below this model's maximum context length of {max_model_len} "
                          f"tokens, got {req.max_tokens}", param="max_tokens", code="context_length_exceeded")
    n = 1 if req.n is None else req.n
    if n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {n}", param="n")
    if req.top_k is not None and req.top_k > vocab_size:
        raise bad_request(f"top_k must be at most the vocabulary size {vocab_size}, got {req.top_k}",
                          param="top_k")
    for t in req.stop_token_ids or ():
        if t >= vocab_size:
            raise bad_request(f"stop_token_ids contains {t}, outside the vocabulary [0, {vocab_size})",
                              param="stop_token_ids")
    for key in req.logit_bias or {}:
        if int(key) >= vocab_size:
            raise bad_request(f"logit_bias names token id {key}, outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
    return n


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int, *,
                   default: int | None, param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """Tokens to generate: ``requested``, else ``default`` (None: the rest of the context).

    400 if the prompt fills the context or prompt + requested exceeds it; a default is
    clamped to what is left instead.
    """
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens, but this model's maximum context length is "
                          f"{max_model_len} tokens (the prompt must leave room for at least one output token)",
                          param=prompt_param,
                          code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if prompt_len + requested > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                          f"{prompt_len + requested} were requested ({prompt_len} in the prompt + "
                          f"{requested} in {param}); reduce the prompt or {param}",
                          param=param, code="context_length_exceeded")
    return requested


def sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                    choice: int) -> SamplingParams:
    """The params of one backend request (choice ``choice`` of ``n``)."""
    kwargs = {
        "n": 1, "max_tokens": max_tokens, "seed": choice_seed(req.seed, choice), "logprobs": logprobs,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "min_tokens": min(req.min_tokens or 0, max_tokens),  # max_tokens always ends the output
        "stop": tuple([req.stop] if isinstance(req.stop, str) else (req.stop or ())),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": bool(req.ignore_eos),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "skip_special_tokens": req.skip_special_tokens is not False,
        "logit_bias": {int(k): v for k, v in (req.logit_bias or {}).items()},
    }
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        msg = str(e)
        param = next((f for f in _FIELDS if msg.startswith(f)), None)
        raise bad_request(msg, param=param) from e
