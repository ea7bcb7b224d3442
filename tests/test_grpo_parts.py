"""The GRPO recipe's parts, in this process: the built-in rewards and the user's, the prompt formats
(GSM8K's included), keyed sampling (chat/rollouts.py: a draw from the softmax, top-p, the same draws
in any batch), the loss's normalisation over the global batch (the sum of the micro-batches' shares
is the whole batch's loss however it is split), the ways of decoding (chat/generation.py: a static
copy gives the eager path's completions) and the token log-probabilities in chunks (the
full-vocabulary ones, gradients included)."""

import json
import math
import types

import pytest
import torch
from accelerate import Accelerator
from chat.generation import KeyedSampling, Sampling, hashed_uniform
from chat.policy_gradient import loss_normaliser
from chat.rewards import (
    Rewards,
    as_prompt_row,
    check_columns,
    gsm8k_answer,
    is_correct,
    last_number,
    load_prompts,
    mean_scored,
)
from chat.rollouts import Rollout, sampling_keys
from grpo import advantages, policy_loss

from accelerate_recipes.errors import RecipeError


def test_the_built_in_rewards():
    completions = [
        "So 3 + 5 = 8.",
        "<answer>8</answer>",
        "It is 1,234.5 in all",
        "eight",
        "<answer>8</answer> ok",
    ]
    completions += ["<answer>1</answer> x <answer>8</answer>"]
    answer = ["8", "8", "1234.5", "8", "8", "8"]
    rewards = Rewards("number,tag,exact,format,length")
    truncated = [False, False, False, False, True, False]
    scores = rewards.score([""] * 6, completions, {"answer": answer, "truncated": truncated})
    assert scores == [
        [1.0, 1.0, 1.0, 0.0, 1.0, 1.0],  # number: the last number written
        [0.0, 1.0, 0.0, 0.0, 1.0, 1.0],  # tag: the answer inside the last <answer>...</answer>
        # exact: the whole completion as written ("<answer>8</answer>" is not "8")
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # format: exactly one tag pair, and nothing after it
        [1.0, 1.0, 1.0, 1.0, 0.0, 1.0],  # length: ended before --max_new_tokens
    ]
    assert Rewards("format").score([""] * 2, ["<answer></answer>", "<answer>a <answer>b</answer>"], {}) == [
        [0, 0]
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
    with pytest.raises(
        RecipeError, match=r"returned \['many'\]; return one float \(or None\) per completion"
    ):
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
        check_columns(
            Rewards("number"), [{"prompt": "a", "answer": "1"}, {"prompt": "b"}], "training prompts"
        )


def test_rewards_written_for_trl_run_unchanged(tmp_path):
    """A reward in TRL's style: conversational completions as message lists, None where it does not
    apply (left out of the weighted sum and of its mean). The built-in rewards read both forms."""
    (tmp_path / "trl_style.py").write_text(
        "def polite(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    texts = [completion[0]['content'] for completion in completions]\n"
        "    assert all(isinstance(ids, list) for ids in completion_ids)\n"
        "    return [None if a == 'skip' else float('please' in t) for t, a in zip(texts, answer)]\n"
    )
    rewards = Rewards(f"{tmp_path / 'trl_style.py'}:polite,number", "2,1")
    conversation = [{"role": "user", "content": "What is 3 + 5?"}]
    columns = {"answer": ["8", "skip", "8"], "completion_ids": [[1], [2], [3]], "truncated": [False] * 3}
    scores = rewards.score([conversation] * 3, ["8, please", "8, please", "9"], columns)
    # number does not apply to "skip": no number in it
    assert scores == [[1.0, None, 0.0], [1.0, 0.0, 0.0]]
    assert rewards.total(scores) == [3.0, 0.0, 0.0]
    assert math.isnan(rewards.total([[None], [None]])[0])  # no reward applies: unscored
    assert [mean_scored(v) for v in scores] == [0.5, pytest.approx(1 / 3)]
    assert not is_correct(None) and is_correct(1.0)
    # plain-text prompts keep plain-text completions, as TRL passes them
    assert Rewards("number").score(["What is 3 + 5?"], ["8"], {"answer": ["8"]}) == [[1.0]]


def rollout_of(rows: int, **fields) -> Rollout:
    """A Rollout of `rows` one-token completions, with the fields a test sets."""
    blank = torch.zeros((rows, 1), dtype=torch.long)
    return Rollout(blank, blank, blank, blank, torch.zeros(rows, dtype=torch.bool), **fields)


def rewarded(rewards: list[float]) -> Rollout:
    return rollout_of(len(rewards), rewards=rewards)


def test_the_spread_of_rewards_a_user_watches():
    """reward_std as TRL logs it (the batch's), the mean spread within groups, and the groups with
    nothing to learn."""
    accelerator = Accelerator(cpu=True)
    rollouts = [rewarded([1.0, 1.0, 1.0, 1.0]), rewarded([0.0, 1.0, 0.0, 1.0])]
    figures = advantages(accelerator, rollouts, 4, "group")
    everything = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1], dtype=torch.float64)
    assert figures["reward_std"] == pytest.approx(everything.std().item())
    assert figures["reward_std_in_group"] == pytest.approx(everything[4:].std().item() / 2)
    assert figures["frac_reward_zero_std"] == 0.5
    assert rollouts[0].advantages.abs().max() == 0 and rollouts[1].advantages[1] > 0
    # a completion no reward applied to (NaN): out of its
    # group's mean and spread, no advantage (as TRL)
    unscored = [rewarded([1.0, math.nan, 0.0, 1.0])]
    figures = advantages(accelerator, unscored, 4, "group")
    scored = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    expected = (scored - scored.mean()) / (scored.std() + 1e-4)
    assert torch.allclose(
        unscored[0].advantages.double(), torch.tensor([expected[0], 0, expected[1], expected[2]])
    )
    assert (
        figures["reward_std"] == pytest.approx(scored.std().item()) and figures["frac_reward_zero_std"] == 0
    )


def test_prompt_formats_and_a_held_out_split(tmp_path):
    assert as_prompt_row({"prompt": "2+2?", "answer": 4}, "x")["messages"] == [
        {"role": "user", "content": "2+2?"}
    ]
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


def sampler(keys, prompt_width=3, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0):
    flags = dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty
    )
    return KeyedSampling(keys, prompt_width, Sampling(**flags), max_new_tokens=8)


def test_keyed_sampling_draws_from_the_softmax_the_same_way_in_any_batch():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    keys = torch.arange(20000, dtype=torch.int64)
    # 3 prompt tokens, 2 written: the completion's 3rd draw
    ids = torch.zeros((len(keys), 5), dtype=torch.long)

    def draws(processor, rows=slice(None), input_ids=ids):
        scores = processor(input_ids[rows], logits.expand(len(keys), -1)[rows])
        assert torch.isinf(scores).sum(dim=-1).eq(3).all()  # one token left, every other at -inf
        return scores.argmax(dim=-1)

    drawn = draws(sampler(keys))
    frequencies = torch.bincount(drawn, minlength=4).float() / len(keys)
    # binomial standard error at 20,000 draws is below 0.0035: 0.015 is over 4 of them
    assert torch.allclose(frequencies, logits.softmax(dim=0), atol=0.015), frequencies
    hot = torch.bincount(draws(sampler(keys, temperature=2.0)), minlength=4).float() / len(keys)
    assert torch.allclose(hot, (logits / 2).softmax(dim=0), atol=0.015), hot
    # top_p 0.8: only the tokens whose likelier neighbours
    # hold less than 0.8 of the mass (here the first two)
    assert set(draws(sampler(keys, top_p=0.8)).tolist()) == {0, 1}
    assert set(draws(sampler(keys, top_k=3)).tolist()) == {0, 1, 2}
    # e^-1 = 0.37 of the likeliest, e^-2 below
    assert set(draws(sampler(keys, min_p=0.3)).tolist()) == {0, 1}
    # a repetition penalty weighs on the tokens the completion
    # wrote (token 0 twice here), not on the prompt's
    written = torch.tensor([[1, 1, 1, 0, 0]]).expand(len(keys), -1)
    penalised = torch.bincount(draws(sampler(keys, repetition_penalty=2.0), input_ids=written), minlength=4)
    assert torch.allclose(penalised.float() / len(keys), torch.tensor([1.0, 1, 0, -1]).softmax(0), atol=0.015)
    # a row's draw depends on its key and its position in the completion only: not on the rows
    # beside it, nor on the left padding that a longer prompt in its batch gives it
    assert torch.equal(draws(sampler(keys[7:8]), slice(7, 8)), drawn[7:8])
    padded = torch.zeros((len(keys), 9), dtype=torch.long)
    assert torch.equal(draws(sampler(keys, prompt_width=7), input_ids=padded), drawn)
    assert not torch.equal(draws(sampler(keys, prompt_width=4)), drawn)
    assert torch.equal(hashed_uniform(keys[7:8], 5), hashed_uniform(keys, 5)[7:8])
    # drawn up front, the same numbers
    assert torch.equal(sampler(keys).uniforms[:, 5], hashed_uniform(keys, 5))
    assert not torch.equal(hashed_uniform(keys, 6), hashed_uniform(keys, 5))
    first, second = (
        sampling_keys(42, 0, torch.tensor([3, 9]), 4),
        sampling_keys(42, 1, torch.tensor([3, 9]), 4),
    )
    assert len(set(first.tolist()) | set(second.tolist())) == 16  # per epoch, prompt and completion
    assert torch.equal(sampling_keys(42, 0, torch.tensor([9]), 4), first[4:])


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_the_micro_batches_shares_add_up_to_the_global_batchs_loss(loss_type):
    """Split a global batch of 4 completions into 2 micro-batches: their shares of the loss sum to
    the loss of the whole batch taken at once, for every normalisation (the one process here plays
    every process)."""
    torch.manual_seed(0)
    args = types.SimpleNamespace(
        epsilon=0.2,
        epsilon_high=None,
        beta=0.0,
        loss_type=loss_type,
        batch_size=2,
        num_generations=2,
        max_new_tokens=6,
    )
    logprobs = torch.randn(4, 6) - 2
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    advantage = torch.tensor([1.0, -1.0, 0.5, -0.5])
    accelerator = types.SimpleNamespace(reduce=lambda tensor, reduction: tensor)

    def share(rows):
        return rollout_of(
            len(mask[rows]),
            loss_mask=mask[rows],
            advantages=advantage[rows],
            old_logprobs=logprobs[rows] + 0.1,
        )

    whole = share(slice(0, 4))
    whole.normaliser = loss_normaliser(accelerator, [whole], args)
    parts = [share(slice(0, 2)), share(slice(2, 4))]
    for part in parts:
        part.normaliser = loss_normaliser(accelerator, parts, args)
    total = sum(
        policy_loss(logprobs[rows], part, args, None)[0]
        for rows, part in zip((slice(0, 2), slice(2, 4)), parts)
    )
    assert total == pytest.approx(policy_loss(logprobs, whole, args, None)[0].item(), abs=1e-7)
    expected = {"dapo": int(mask.sum()), "grpo": 4, "dr_grpo": 4 * 6}[loss_type]
    assert float(whole.normaliser) == expected


def test_rollouts_follow_the_recipes_flags_only_whatever_the_models_generation_config_says(tiny_chat_model):
    """A model whose own generation_config bans repeats, penalises them and suppresses tokens:
    greedy answers and keyed samples are still those of the plain softmax, the policy whose
    log-probabilities the update uses."""
    from chat.model import load_base_model, load_tokenizer
    from chat.policy_gradient import token_logprobs
    from chat.rollouts import generate, sampling_keys
    from grpo import GrpoFlags

    accelerator = Accelerator(cpu=True)
    tokenizer, model = load_tokenizer(str(tiny_chat_model)), load_base_model(str(tiny_chat_model)).eval()
    args = GrpoFlags(max_new_tokens=8, temperature=1.0)
    chats = [[{"role": "user", "content": f"What colour is the {thing}?"}] for thing in ("sky", "ripe plum")]
    prompts = [
        tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True))["input_ids"]
        for c in chats
    ]
    keys = sampling_keys(0, 0, torch.tensor([0, 1]), 2)
    prompts = [p for p in prompts for _ in range(2)]
    plain_greedy = generate(accelerator, model, tokenizer, prompts, args)
    plain_sampled = generate(accelerator, model, tokenizer, prompts, args, keys)
    first_tokens = plain_greedy.completion[:, 0].tolist() + plain_sampled.completion[:, 0].tolist()
    own = model.generation_config
    own.update(repetition_penalty=5.0, no_repeat_ngram_size=1, suppress_tokens=first_tokens, min_new_tokens=4)
    greedy = generate(accelerator, model, tokenizer, prompts, args)
    sampled = generate(accelerator, model, tokenizer, prompts, args, keys)
    assert torch.equal(greedy.completion, plain_greedy.completion)
    assert torch.equal(sampled.completion, plain_sampled.completion)
    # the model's own is put back afterwards
    assert model.generation_config.repetition_penalty == 5.0
    # greedy: every token is the argmax of the update's own softmax
    logits = model(
        input_ids=torch.cat([greedy.prompt, greedy.completion], 1),
        attention_mask=torch.cat([greedy.prompt_mask, greedy.mask], 1),
        position_ids=(torch.cat([greedy.prompt_mask, greedy.mask], 1).cumsum(1) - 1).clamp(min=0),
    ).logits[:, greedy.prompt.shape[1] - 1 : -1]
    chosen = logits.argmax(-1)
    assert torch.equal(
        (chosen == greedy.completion)[greedy.mask.bool()], greedy.mask.bool()[greedy.mask.bool()]
    )
    assert token_logprobs(model, sampled, 1.0).isfinite().all()


def test_the_kl_reference_of_a_fresh_adapter_is_the_policy_it_starts_from(tiny_chat_model):
    """--beta with a fresh LoRA adapter: the reference is the base with the adapter off, the policy
    at step 1 (KL 0); the frozen-copy case (an adapter given in --model) is run end to end in
    test_grpo.py."""
    from chat.model import BASE, build_model, load_tokenizer, reference_policy
    from chat.policy_gradient import reference_token_logprobs, token_logprobs
    from chat.rollouts import generate
    from grpo import GrpoFlags

    accelerator = Accelerator(cpu=True)
    args = GrpoFlags(lora_r=4, beta=0.04, max_new_tokens=4)
    tokenizer = load_tokenizer(str(tiny_chat_model))
    model = build_model(args, str(tiny_chat_model), accelerator)
    assert reference_policy(args, accelerator, model, str(tiny_chat_model)) == BASE
    chat = [{"role": "user", "content": "What colour is the sky?"}]
    prompt = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))[
        "input_ids"
    ]
    rollout = generate(accelerator, model, tokenizer, [prompt], args)
    with torch.no_grad():
        policy = token_logprobs(model, rollout, args.temperature)
        reference = reference_token_logprobs(model, BASE, rollout, args, accelerator)
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.add_(0.5)  # a trained adapter: now the reference differs
        moved = token_logprobs(model, rollout, args.temperature)
    assert torch.equal(policy, reference)
    assert not torch.allclose(moved, reference)
    assert torch.equal(reference_token_logprobs(model, BASE, rollout, args, accelerator), reference)


def chat_prompts(tokenizer, things: list[str]) -> list[list[int]]:
    chats = [[{"role": "user", "content": f"What colour is the {thing}?"}] for thing in things]
    return [
        tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True))["input_ids"]
        for c in chats
    ]


@pytest.mark.parametrize(("lora_r", "mode"), [(0, "static"), (4, "static"), (4, "compiled")])
def test_a_static_copy_decodes_the_eager_paths_completions_and_follows_the_trained_weights(
    tiny_chat_model, lora_r, mode
):
    """--decode static (a copy of the model, LoRA merged into its weights, a static KV cache, rows
    and cache length rounded up to buckets) and compiled (its decode step through torch.compile, as
    a GPU runs it but for the CUDA graphs) against eager generate on the trained model itself, in
    fp32: the same greedy answers and the same keyed samples, for prompts of different widths and a
    row count off the bucket; after the weights move, the next call decodes the moved model's
    completions (the copy is refreshed at every call, the compiled step reads it) and compiles
    nothing new: a GRPO step's rollouts reuse the graphs of the first.

    compiled reserves one cache for the longest prompts first, as grpo.py does
    (generation.reserve_cache): prompts of a second length bucket (over 64 tokens) then decode in
    it, the same completions again, and compile nothing (a recompile would be an error); static,
    reserving nothing, makes a cache per bucket. The compiled step compiles with aot_eager (as
    the recipes' CPU tests run --compile): caches, guards and recompiles are torch.compile's
    capture, whatever backend then generates the kernels."""
    from chat import generation
    from chat.generation import ROW_BUCKET
    from chat.model import build_model, load_tokenizer
    from chat.rollouts import generate
    from grpo import GrpoFlags
    from torch._dynamo.utils import counters

    accelerator = Accelerator(cpu=True)
    args = GrpoFlags(lora_r=lora_r, max_new_tokens=10, temperature=0.7, top_p=0.95)
    tokenizer = load_tokenizer(str(tiny_chat_model))
    torch.manual_seed(0)
    model = build_model(args, str(tiny_chat_model), accelerator)
    moved = [p for name, p in model.named_parameters() if ("lora_B" in name if lora_r else "mlp" in name)]
    with torch.no_grad():
        # a trained adapter (peft starts B at zero: the merge would add nothing)
        for weight in moved:
            weight.normal_(0, 0.05)
    prompts = [p for p in chat_prompts(tokenizer, ["sky", "ripe plum", "grass"]) for _ in range(2)]
    assert len(prompts) % ROW_BUCKET and len(set(map(len, prompts))) > 1
    long = [p for p in chat_prompts(tokenizer, ["sky " * 30, "ripe plum " * 20, "grass"]) for _ in range(2)]
    shape = generation.cache_shape(len(prompts), max(map(len, long)), args.max_new_tokens)
    assert max(map(len, prompts)) <= 64 < max(map(len, long)) and shape == (ROW_BUCKET, 128 + 10)
    keys = sampling_keys(0, 0, torch.tensor([0, 1, 2]), 2)

    def both(keys=None, prompts=prompts):
        args.decode = "eager"
        eager = generate(accelerator, model, tokenizer, prompts, args, keys)
        args.decode = mode
        static = generate(accelerator, model, tokenizer, prompts, args, keys)
        assert torch.equal(static.mask, eager.mask) and torch.equal(static.truncated, eager.truncated)
        assert torch.equal(static.completion * static.mask, eager.completion * eager.mask)
        return eager

    before = counters["stats"]["unique_graphs"]
    if mode == "compiled":
        generation.use_decode_backend(model, "aot_eager")
        decoder = generation.reserve_cache(accelerator, model, *shape, mode)
    sampled, greedy = both(keys), both()
    assert not torch.equal(sampled.completion, greedy.completion)
    compiled = counters["stats"]["unique_graphs"]
    assert (compiled > before) == (mode == "compiled")
    with torch._dynamo.config.patch(error_on_recompile=True):
        both(keys, long)
    # the decode's net would have caught a recompile and gone eager: it did not
    if mode == "compiled":
        assert list(decoder.caches) == [shape] and generation.decode_path(model).fallback is None
    with torch.no_grad():
        for weight in moved:
            weight.mul_(-2)
    # the copy decoded the moved weights
    assert not torch.equal(both(keys).completion, sampled.completion)
    # the next step's rollouts: no graph compiled again
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("lora_r", [0, 4])
def test_token_logprobs_in_chunks_are_the_full_vocabularys_with_their_gradients(
    tiny_chat_model, lora_r, monkeypatch
):
    """model.token_logprobs (the last tokens' logits a chunk of rows at a time, at a temperature)
    against the log-softmax of the model's own logits in fp32: values within 1e-6 and the gradients
    of a weighted sum within 1e-6 relative, with many chunks and with one; a deep copy of the model
    (a full fine-tune's reference) scores with its own weights."""
    import copy

    from chat import answer_loss
    from chat.model import build_model, load_tokenizer, token_logprobs
    from chat.rollouts import generate
    from grpo import GrpoFlags

    accelerator = Accelerator(cpu=True)
    args = GrpoFlags(lora_r=lora_r, max_new_tokens=12, decode="eager")
    tokenizer = load_tokenizer(str(tiny_chat_model))
    torch.manual_seed(0)
    model = build_model(args, str(tiny_chat_model), accelerator)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.05)
    prompts = [p for p in chat_prompts(tokenizer, ["sky", "ripe plum"]) for _ in range(3)]
    rollout = generate(
        accelerator, model, tokenizer, prompts, args, sampling_keys(0, 0, torch.tensor([0, 1]), 3)
    )
    input_ids = torch.cat([rollout.prompt, rollout.completion], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.mask], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    targets, temperature = rollout.completion, 0.7
    weights = torch.linspace(-1, 1, targets.numel()).reshape(targets.shape)

    def with_gradients(logprobs_of) -> tuple:
        model.zero_grad()
        logprobs = logprobs_of()
        (logprobs * weights).sum().backward()
        return logprobs.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    # the model's own forward pass (no logprob_targets) and a log-softmax over every token
    def full_vocabulary():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, -targets.shape[1] - 1 : -1].float() / temperature
        return logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)

    expected, expected_grads = with_gradients(full_vocabulary)
    vocab = model.config.vocab_size
    # positions the output layer itself is given: the chunks' logits are made beside it
    head_rows = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, i, out: head_rows.append(out.shape[:-1].numel())
    )
    for rows in (5, targets.numel()):  # 15 chunks of 5 positions, then one chunk
        monkeypatch.setattr(answer_loss, "CHUNK_LOGITS", rows * vocab)
        chunked, grads = with_gradients(
            lambda: token_logprobs(model, input_ids, mask, targets, positions, temperature)
        )
        assert chunked.dtype == torch.float32 and chunked.shape == targets.shape
        # never the whole vocabulary's logits of every target at once
        assert head_rows == [0], head_rows
        head_rows.clear()
        assert torch.allclose(chunked, expected, rtol=0, atol=1e-6), (chunked - expected).abs().max()
        assert grads.keys() == expected_grads.keys() and len(grads) > 0
        for name, grad in grads.items():
            scale = expected_grads[name].abs().max()
            assert (grad - expected_grads[name]).abs().max() <= 1e-6 * scale + 1e-9, name
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for weight in reference.parameters():
            weight.add_(0.01)
        moved = token_logprobs(reference, input_ids, mask, targets, positions, temperature)
        assert not torch.allclose(moved, expected, atol=1e-3)
        assert torch.equal(token_logprobs(model, input_ids, mask, targets, positions, temperature), chunked)


def test_the_throughput_leaves_the_first_step_out_of_the_rates_and_reports_its_seconds():
    """The first optimizer step (compilation, warm-up) is reported in seconds; the rates are the
    later steps'."""
    from chat.rollouts import Throughput

    speed = Throughput(Accelerator(cpu=True))
    speed.generated(100, 4.0)
    speed.update_started()
    speed.trained(500)
    speed.update_ended()
    alone = speed.rates()
    assert alone["generation_tokens_per_second"] == 25.0 and alone["first_step_generation_seconds"] == 4.0
    speed.generated(300, 1.0)
    speed.generated(300, 2.0)
    steady = speed.rates()
    assert steady["generation_tokens_per_second"] == 200.0 and steady["first_step_generation_seconds"] == 4.0
    assert steady["train_tokens_per_second"] == alone["train_tokens_per_second"] > 0
