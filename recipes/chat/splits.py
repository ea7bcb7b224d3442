"""The data flags of GRPO (recipes/grpo.py) and DPO (recipes/dpo.py) read into their two splits:
--train_file and --validation_file, or --dataset, with --validation_size held out when no validation
data is given (chat/rewards.py reads prompts, chat/preference_pairs.py pairs).
"""


def read_splits(accelerator, args, read) -> tuple:
    """(training rows, validation rows): `read` (load_prompts, load_pairs) of the data flags. The
    local main process of each node reads first (into the datasets cache); the others then read the
    cached files."""
    with accelerator.local_main_process_first():
        return read(
            args.train_file,
            args.validation_file,
            args.dataset,
            args.cache_dir,
            args.validation_size,
            args.seed,
        )
