"""The chat-model layer that sft.py, dpo.py and grpo.py share; none of the three imports another.

model.py             loading a chat model (Hub name, folder, .gguf), LoRA, the reference policy,
                     compiled blocks, saving, and --predict / --chat / --merge
conversations.py     chat files and hub datasets to conversations, and conversations to token ids
                     with the loss on the assistant's turns only
packing.py           micro-batches: padded rows, packed rows, rows of a token budget
answer_loss.py       the loss over answer tokens and the token log-probabilities, their logits made
                     a chunk at a time
generation.py        generation: eager, or a merged copy with a static KV cache and a compiled decode step
packed_attention.py  the `varlen` attention for packed rows
memory_plan.py       the memory plan printed before training, and the change that makes a run fit
preference_pairs.py  DPO's preference pairs (dpo.py alone)
rewards.py           GRPO's prompts and rewards (grpo.py alone)
rollouts.py          GRPO's rollouts: keyed sampling, scoring, the figures logged of them, and the
                     throughput meter (grpo.py alone)
"""
