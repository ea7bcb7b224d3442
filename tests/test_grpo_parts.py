"""The GRPO recipe's parts, in this process: the built-in rewards and the user's, the prompt formats (GSM8K's
included), keyed sampling (a draw from the softmax, top-p, the same draws in any batch), and the loss's normalisation
over the global batch (the sum of the micro-batches' shares is the whole batch's loss however it is split)."""

import json
import types

import pytest
import torch
from grpo import KeyedSampling, hashed_uniform, loss_normaliser, policy_loss, sampling_keys
from grpo_rewards import Rewards, as_prompt_row, check_columns, gsm8k_answer, last_number, load_prompts

from accelerate_recipes.errors import RecipeError


def test_the_built_in_rewards():
    completions = ["So 3 + 5 = 8.", "<answer>8</answer>", "It is 1,234.5 in all", "eight", "<answer>8</answer> ok"]
    answer = ["8", "8", "1234.5", "8", "8"]
    rewards = Rewards("number,tag,exact,format,length")
    scores = rewards.score([""] * 5, completions, {"answer": answer, "truncated": [False, False, False, False, True]})
    assert scores == [
        [1.0, 1.0, 1.0, 0.0, 1.0],  # number: the last number written
        [0.0, 1.0, 0.0, 0.0, 1.0],  # tag: the answer inside <answer>...</answer>
        [0.0, 0.0, 0.0, 0.0, 0.0],  # exact: the whole completion as written ("<answer>8</answer>" is not "8")
        [0.0, 1.0, 0.0, 0.0, 0.0],  # format: one tag pair, and nothing after it
        [1.0, 1.0, 1.0, 1.0, 0.0],  # length: ended before --max_new_tokens
    ]
    assert rewards.total(scores)[1] == sum(s[1] for s in scores)
    assert Rewards("exact").score([""], ["Yellow."], {"answer": ["yellow"], "truncated": [False]}) == [[1.0]]
    weighted = Rewards("number,format", "1,0.5")
    assert weighted.total([[1.0, 0.0], [1.0, 1.0]]) == [1.5, 0.5]
    assert last_number("no digits") is None and gsm8k_answer("so 5 + 7 = 12\n#### 1,200") == "1200"


def test_the_users_reward_functions_and_their_failures_are_one_line(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def shout(prompts, completions, answer, **columns):\n"
        "    return [float(c.isupper()) for c in completions]\n"
        "def boom(prompts, completions, **columns):\n"
        "    raise ValueError('no luck')\n"
        "def nan(prompts, completions, **columns):\n"
        "    return [float('nan')] * len(completions)\n"
        "def words(prompts, completions, **columns):\n"
        "    return ['many'] * len(completions)\n"
    )
    mine = f"{tmp_path / 'mine.py'}"
    rewards = Rewards(f"{mine}:shout,exact")
    assert rewards.names == ["shout", "exact"]
    assert rewards.score(["q", "q"], ["YES", "no"], {"answer": ["no", "no"]}) == [[1.0, 0.0], [0.0, 1.0]]
    with pytest.raises(RecipeError, match="mine.py:boom raised ValueError: no luck; fix the function"):
        Rewards(f"{mine}:boom").score(["q"], ["a"], {})
    with pytest.raises(RecipeError, match="NaN or infinite"):
        Rewards(f"{mine}:nan").score(["q"], ["a"], {})
    with pytest.raises(RecipeError, match=r"returned \['many'\]; return one float per completion"):
        Rewards(f"{mine}:words").score(["q"], ["a"], {})
    with pytest.raises(RecipeError, match="has no function 'missing'"):
        Rewards(f"{mine}:missing")
    with pytest.raises(RecipeError, match="nothing.py does not exist"):
        Rewards(f"exact,{tmp_path / 'nothing.py'}:f")
    with pytest.raises(RecipeError, match="not a built-in reward"):
        Rewards("nonsense")
    with pytest.raises(RecipeError, match="gives 1 weight"):
        Rewards("number,format", "1")
    with pytest.raises(RecipeError, match="row 2 has no `answer`"):
        check_columns(Rewards("number"), [{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "training prompts")


def test_prompt_formats_and_a_held_out_split(tmp_path):
    assert as_prompt_row({"prompt": "2+2?", "answer": 4}, "x")["messages"] == [{"role": "user", "content": "2+2?"}]
    chat = as_prompt_row(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]},
        "x",
    )  # fmt: skip
    assert chat["answer"] == "Hello" and [m["role"] for m in chat["messages"]] == ["system", "user"]
    gsm8k = as_prompt_row({"question": "How many?", "answer": "3 and 4 make 7.\n#### 7"}, "x")
    assert gsm8k["prompt"] == "How many?" and gsm8k["answer"] == "7"
    with pytest.raises(RecipeError, match="without `prompt`, `messages` or `question`"):
        as_prompt_row({"text": "hi"}, "train.jsonl, row 1")
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, validation = load_prompts(tmp_path / "gsm8k.jsonl", None, None, None, 0.25, seed=0)
    assert len(train) == 15 and len(validation) == 5
    assert {r["prompt"] for r in train} | {r["prompt"] for r in validation} == {f"q{i}" for i in range(20)}


def test_keyed_sampling_draws_from_the_softmax_the_same_way_in_any_batch():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    keys = torch.arange(20000, dtype=torch.int64)
    ids = torch.zeros((len(keys), 5), dtype=torch.long)

    def draws(sampler, rows=slice(None), position_ids=ids):
        scores = sampler(position_ids[rows], logits.expand(len(keys), -1)[rows])
        assert torch.isinf(scores).sum(dim=-1).eq(3).all()  # one token left, every other at -inf
        return scores.argmax(dim=-1)

    drawn = draws(KeyedSampling(keys, temperature=1.0, top_p=1.0))
    frequencies = torch.bincount(drawn, minlength=4).float() / len(keys)
    # binomial standard error at 20,000 draws is below 0.0035: 0.015 is over 4 of them
    assert torch.allclose(frequencies, logits.softmax(dim=0), atol=0.015), frequencies
    hot = torch.bincount(draws(KeyedSampling(keys, 2.0, 1.0)), minlength=4).float() / len(keys)
    assert torch.allclose(hot, (logits / 2).softmax(dim=0), atol=0.015), hot
    # top_p 0.8: only the tokens whose likelier neighbours hold less than 0.8 of the mass (here the first two)
    assert set(draws(KeyedSampling(keys, 1.0, 0.8)).tolist()) == {0, 1}
    # a row's draw depends on its key and position only, not on the rows beside it
    assert torch.equal(draws(KeyedSampling(keys[7:8], 1.0, 1.0), slice(7, 8)), drawn[7:8])
    assert torch.equal(hashed_uniform(keys[7:8], 5), hashed_uniform(keys, 5)[7:8])
    assert not torch.equal(hashed_uniform(keys, 6), hashed_uniform(keys, 5))
    first, second = sampling_keys(42, 0, torch.tensor([3, 9]), 4), sampling_keys(42, 1, torch.tensor([3, 9]), 4)
    assert len(set(first.tolist()) | set(second.tolist())) == 16  # per epoch, prompt and completion
    assert torch.equal(sampling_keys(42, 0, torch.tensor([9]), 4), first[4:])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_the_micro_batches_shares_add_up_to_the_global_batchs_loss(loss_type):
    """Split a global batch of 4 completions into 2 micro-batches: their shares of the loss sum to the loss of the
    whole batch taken at once, for every normalisation (the one process here plays every process)."""
    torch.manual_seed(0)
    args = types.SimpleNamespace(
        epsilon=0.2, epsilon_high=None, beta=0.0, loss_type=loss_type, batch_size=2, num_generations=2, max_new_tokens=6
    )
    logprobs = torch.randn(4, 6) - 2
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    advantage = torch.tensor([1.0, -1.0, 0.5, -0.5])
    accelerator = types.SimpleNamespace(reduce=lambda tensor, reduction: tensor)

    def share(rows):
        rollout = {"loss_mask": mask[rows], "advantages": advantage[rows], "old_logprobs": logprobs[rows] + 0.1}
        return rollout

    whole = share(slice(0, 4))
    whole["normaliser"] = loss_normaliser(accelerator, [whole], args)
    parts = [share(slice(0, 2)), share(slice(2, 4))]
    for part in parts:
        part["normaliser"] = loss_normaliser(accelerator, parts, args)
    total = sum(
        policy_loss(logprobs[rows], part, args, None)[0] for rows, part in zip((slice(0, 2), slice(2, 4)), parts)
    )
    assert total == pytest.approx(policy_loss(logprobs, whole, args, None)[0].item(), abs=1e-7)
    expected = {"dapo": int(mask.sum()), "grpo": 4, "dr_grpo": 4 * 6}[loss_type]
    assert float(whole["normaliser"]) == expected
