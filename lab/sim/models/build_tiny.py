"""Build the tiny Llama model directory served by the simulator and by real vLLM on CPU.

The directory holds a byte-level BPE tokenizer trained on the Python standard library's
sources, a Llama config for a ~1M-parameter model, and a chat template. No weights are
written: real vLLM serves it with ``--load-format dummy``; the simulator only needs the
tokenizer. The output is committed (``lab/sim/models/tiny``), so this script runs only when the
tokenizer or config changes::

    python -m sim.models.build_tiny [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "vocab_size": VOCAB_SIZE,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}


def stdlib_corpus(limit_files: int = 400) -> Iterator[str]:
    """Yield the text of the first ``limit_files`` stdlib modules, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py"))[:limit_files]:
        yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_corpus(), trainer=trainer)
    return tokenizer


def write_model_dir(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": LLAMA_CONFIG["max_position_embeddings"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "tiny")
    write_model_dir(parser.parse_args().out)


if __name__ == "__main__":
    main()
