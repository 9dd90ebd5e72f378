"""The tiny tokenizer and dataset a torchtitan test job trains on (tests/loops/torchtitan_job.py).

A word-level tokenizer (Hugging Face ``tokenizers``, the format torchtitan's
``HuggingFaceTokenizer`` loads) over a vocabulary of a few hundred made-up words,
and a ``c4_test``-shaped dataset (JSON lines with a ``text`` field) of sentences
drawn from it with a fixed seed. Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def make_assets(root: Path, documents: int = 400, words: int = 300, seed: int = 0) -> Path:
    """Writes ``root/tokenizer`` and ``root/c4_test``; returns ``root``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(words)]
    texts = [" ".join(rng.choice(vocabulary) for _ in range(rng.randrange(40, 160))) + "."
             for _ in range(documents)]
    data = root / "c4_test"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")

    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=[UNK, BOS, EOS]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, tokenizer.token_to_id(BOS)), (EOS, tokenizer.token_to_id(EOS))])
    assets = root / "tokenizer"
    assets.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return root
