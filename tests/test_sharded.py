"""FSDP2 and DeepSpeed ZeRO-2 and ZeRO-3 run the text recipe for real on 2 CPU processes over gloo,
launched with the shipped fsdp.yaml / deepspeed.yaml, and train exactly what DDP (cpu.yaml) trains
with the same flags."""

import pytest
import torch
from conftest import (
    TEXT_SCRIPT,
    losses,
    read_results,
    sharded_launch,
    stopped_with,
)
from transformers import AutoModelForSequenceClassification, AutoTokenizer

# 256 rows, global batch 16 over 2 processes x 2 accumulation steps: 16 optimizer steps per epoch,
# 32 in all. --max_grad_norm 0.05 clips on most steps (without it the DDP loss differs by 0.1 by
# step 32), so the runs agree only if every backend clips the same global norm, and accumulates as
# the flag says.
FLAGS = [
    "--batch_size",
    "16",
    "--gradient_accumulation_steps",
    "2",
    "--max_grad_norm",
    "0.05",
    "--lr",
    "3e-3",
    "--epochs",
    "2",
    "--checkpoint_every",
    "12",
    "--keep_checkpoints",
    "5",
    "--log_every",
    "1",
    "--tracker",
    "none",
    "--num_workers",
    "0",
]
# The same fp32 arithmetic on the same micro-batches; only the order of the gradient sums differs
# (all-reduce vs reduce-scatter), which moves the loss by ~1e-7 here (measured max 6e-8 over 32
# steps). A wrong batch, a missed accumulation step or
# another clipping shifts it by > 1e-2 within a few steps.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def data(text_data, module_tmp):
    """conftest's tiny BERT and reviews (256 training rows, 63 validation rows); the runs write
    under their own root."""
    return dict(text_data, root=module_tmp.mktemp("sharded"))


def launch(data, name, config, *extra, launcher=(), ok=True):
    """The text recipe with the data's files and FLAGS, on 2 CPU processes under `config`."""
    files = ["--model", data["model"], "--train_file", data["train"], "--validation_file", data["validation"]]
    return sharded_launch(
        data["root"], name, config, TEXT_SCRIPT, *files, *FLAGS, *extra, launcher=launcher, ok=ok
    )


@pytest.fixture(scope="module")
def ddp(data):
    return launch(data, "ddp", "cpu.yaml")[1]


@pytest.fixture(scope="module")
def fsdp(data):
    return launch(data, "fsdp", "fsdp.yaml")[1]


def assert_same_losses(run_dir, reference, tolerance=TOLERANCE):
    ours, theirs = losses(run_dir), losses(reference)
    assert ours and set(ours) <= set(theirs)
    worst = max(abs(ours[s] - theirs[s]) for s in ours)
    assert worst <= tolerance, (worst, ours, theirs)


def test_fsdp_on_cpu_shards_and_trains_like_ddp(fsdp, ddp):
    results = read_results(fsdp)
    assert results["distributed_type"] == "FSDP" and results["world_size"] == 2
    assert results["steps"] == 32 and results["per_process_batch_size"] == 4
    assert_same_losses(fsdp, ddp)
    steps = losses(fsdp)
    assert steps[32] < steps[1] - 0.15, steps
    assert results["eval_accuracy"] >= 0.8
    # SHARDED_STATE_DICT: each rank wrote its own shard of
    # weights and optimizer state, no gathered copy.
    checkpoint = fsdp / "checkpoints" / "step_00000012"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    assert not list(checkpoint.glob("model*.safetensors")) and not list(checkpoint.glob("pytorch_model*.bin"))


def test_fsdp_resumes_mid_epoch_from_a_sharded_checkpoint(data, fsdp):
    # step 24: 8 steps into the second epoch of 16
    proc, resumed = launch(
        data, "fsdp-resumed", "fsdp.yaml", "--resume", fsdp / "checkpoints" / "step_00000024"
    )
    assert "resumed from" in proc.output and "step 24 of 32" in proc.output
    results = read_results(resumed)
    assert results["distributed_type"] == "FSDP" and results["steps"] == 32
    assert sorted(losses(resumed)) == list(range(25, 33))
    # Same weights, optimizer moments, schedule, RNG and
    # data position: the continuation is the same run.
    assert_same_losses(resumed, fsdp, tolerance=1e-6)


def test_fsdp_saved_model_is_the_whole_trained_model(data, fsdp, ddp):
    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    model = AutoModelForSequenceClassification.from_pretrained(fsdp).eval()
    saved = model.state_dict()
    # The last checkpoint's shards, merged offline, are exactly what save_pretrained gathered.
    merged = data["root"] / "merged"
    merge_fsdp_weights(str(fsdp / "checkpoints" / "step_00000032" / "pytorch_model_fsdp_0"), str(merged))
    shards = load_file(merged / "model.safetensors")
    assert set(shards) == set(saved)
    assert all(torch.equal(shards[k], saved[k]) for k in saved)
    reference = AutoModelForSequenceClassification.from_pretrained(ddp).state_dict()
    assert max((saved[k] - reference[k]).abs().max().item() for k in saved) < 1e-4
    # model_best, gathered the same way at the best evaluation:
    # the whole model of that epoch's sharded checkpoint.
    best_step = read_results(fsdp)["best_step"]
    merge_fsdp_weights(
        str(fsdp / "checkpoints" / f"step_{best_step:08d}" / "pytorch_model_fsdp_0"),
        str(data["root"] / "merged-best"),
    )
    shards = load_file(data["root"] / "merged-best" / "model.safetensors")
    best = AutoModelForSequenceClassification.from_pretrained(fsdp / "model_best").state_dict()
    assert set(shards) == set(best) and all(torch.equal(shards[k], best[k]) for k in best)
    tokenizer = AutoTokenizer.from_pretrained(fsdp)
    with torch.no_grad():
        ids = (
            model(
                **tokenizer(["great superb lovely", "awful dull boring"], padding=True, return_tensors="pt")
            )
            .logits.argmax(-1)
            .tolist()
        )
    assert [model.config.id2label[i] for i in ids] == ["positive", "negative"]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_cpu_takes_the_recipes_accumulation_and_clipping(stage, data, ddp):
    # ZeRO-3 also shards the weights while from_pretrained
    # reads them, which takes every process at once.
    _, out = launch(data, f"zero{stage}", "deepspeed.yaml", launcher=["--zero_stage", str(stage)])
    results = read_results(out)
    assert results["distributed_type"] == "DEEPSPEED" and results["gradient_accumulation_steps"] == 2
    # ZeRO-2 writes mp_rank_00_model_states.pt, ZeRO-3 one
    # zero_pp_rank_<r>_mp_rank_00_model_states.pt per rank.
    states = sorted(
        (out / "checkpoints" / "step_00000012" / "pytorch_model").glob("*mp_rank_00_model_states.pt")
    )
    engine = torch.load(states[0], map_location="cpu", weights_only=False)["ds_config"]
    assert engine["gradient_clipping"] == 0.05 and engine["gradient_accumulation_steps"] == 2
    assert engine["train_batch_size"] == 16 and engine["zero_optimization"]["stage"] == stage
    # ZeRO-3 on the CPU does not keep the recipe's no-decay group apart (biases and LayerNorm
    # weights): with --weight_decay 0.01 its losses drift from DDP's by ~1.3e-4 over 32 steps, with
    # 0 they agree within 6e-8 (measured by hand). Still far below what a wrong batch, accumulation
    # or clipping does (> 1e-2).
    assert_same_losses(out, ddp, tolerance=TOLERANCE if stage == 2 else 1e-3)
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 2


def test_accumulation_pinned_by_the_launcher_stops_the_run(data):
    # What a `gradient_accumulation_steps: 4` line in a DeepSpeed accelerate config does: the
    # launcher exports it.
    pinned = ["--zero_stage", "2", "--gradient_accumulation_steps", "4"]
    proc, out = launch(data, "pinned", "deepspeed.yaml", launcher=pinned, ok=False)
    stopped_with(
        proc, out, "--gradient_accumulation_steps is 2 but the accelerate or DeepSpeed config sets 4"
    )


def test_skip_nonfinite_steps_is_refused_under_deepspeed(data):
    proc, out = launch(
        data, "skip", "deepspeed.yaml", "--skip_nonfinite_steps", launcher=["--zero_stage", "2"], ok=False
    )
    stopped_with(
        proc, out, "--skip_nonfinite_steps cannot work under DeepSpeed: accelerator.backward() already steps"
    )
