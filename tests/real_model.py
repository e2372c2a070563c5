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
# ~900 tokens as a chat prompt: past several 256-key decode-attention chunks and prefill chunks
LONG_QUESTION = " ".join(
    f"Shelf {i} holds {(i * 7) % 13 + 1} {('red', 'green', 'blue', 'yellow')[i % 4]} boxes."
    for i in range(80)) + " Which shelf holds the most boxes, and what colour are they?"


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def transformers_reference(gguf_path: Path) -> dict:
    """transformers' tokenizer, chat prompts and greedy continuations (fp32, up to MAX_NEW)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw).eval()
    prompts = [list(tok.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for q in QUESTIONS]
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=EOS, pad_token_id=EOS)
            outputs.append(out[0, len(ids):].tolist())
    return {"tokenizer": tok, "prompts": prompts, "outputs": outputs}
