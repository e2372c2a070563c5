"""The real default model's parity reference: transformers loading the same GGUF."""

from __future__ import annotations

from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is the boiling point of water in Celsius?",
]
MAX_NEW = 16
EOS = 2  # <|im_end|>
# ~940 tokens each as chat prompts: several prefill chunks and 256-key decode-attention chunks.
# Openings that differ, so no request finds another's prompt in the prefix cache.
_SHELVES = " ".join(
    f"Shelf {i} holds {(i * 7) % 13 + 1} {('red', 'green', 'blue', 'yellow')[i % 4]} boxes."
    for i in range(80)) + " Which shelf holds the most boxes, and what colour are they?"
LONG_QUESTIONS = tuple(f"{opening} {_SHELVES}" for opening in (
    "Read this list.", "Here is an inventory.", "Look at these shelves."))

def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def transformers_reference(gguf_path: Path) -> dict:
    """transformers' tokenizer, chat prompts and greedy continuations (fp32, up to MAX_NEW): of
    QUESTIONS ("prompts", "outputs") and of LONG_QUESTIONS ("long_prompts", "long_outputs")."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw).eval()
    prompts = [list(tok.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for q in QUESTIONS]
    long_prompts = [list(tok.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)) for q in LONG_QUESTIONS]
    with torch.no_grad():
        outputs, long_outputs = ([hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                              eos_token_id=EOS, pad_token_id=EOS)[0, len(ids):].tolist()
                                  for ids in batch] for batch in (prompts, long_prompts))
    return {"tokenizer": tok, "prompts": prompts, "outputs": outputs,
            "long_prompts": long_prompts, "long_outputs": long_outputs}
