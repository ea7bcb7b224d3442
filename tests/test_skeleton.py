"""The skeleton every recipe shares stays the same in each of them.

A recipe is a template: the calls that build the Accelerator and wire the progress and checkpoints
(their plumbing written once, in accelerate_recipes.shared_steps), the resume block, the
bookkeeping, the inner step with Accelerate's own calls, the evaluation's bookkeeping and the final
save are written out in every recipe, because that is what a reader copies. Nothing else keeps the
copies in step, so this test does (as Accelerate's own test suite does for its examples): each
recipe's training function must hold SKELETON's lines, in this order, after a recipe's names are
mapped to the common ones. Lines a recipe adds between them (its own Accelerator arguments, its
loss, its evaluation) are its own.

It also holds each recipe to the shape the README promises: one function per mode behind the same
`main`, training in the recipe and the other modes (evaluate_saved_model, predict) in its modes
module beside it (`<recipe>_modes.py`, detect's `modes.py`; the chat recipes' --predict, --chat and
--merge in chat/modes.py), a training function of at most 150 code lines, and flags that extend the
shared TrainingFlags without changing a shared flag's type.
"""

import ast
import dataclasses
import functools
import io
import re
import tokenize
import typing

import pytest
from conftest import REPO

from accelerate_recipes.flags import TrainingFlags

RECIPES = {
    "cifar": REPO / "recipes" / "cifar.py",
    "text": REPO / "recipes" / "text_classification.py",
    "detect": REPO / "recipes" / "detect" / "train.py",
    "sft": REPO / "recipes" / "sft.py",
    "grpo": REPO / "recipes" / "grpo.py",
    "dpo": REPO / "recipes" / "dpo.py",
}
# their flags extend the chat-model layer's, which extend TrainingFlags
CHAT_RECIPES = ("sft", "grpo", "dpo")

SKELETON = """
# ---- accelerator: distributed set-up, precision, tracking, gradient accumulation
tracking = setup_tracker(args.tracker, output, args.run_name or RUN_NAME, args.swanlab_mode)
accelerator = training_accelerator(args, tracking)
per_process = check_launch_flags(accelerator, args)
set_seed(args.seed)
prepare_output_dir(output)
checkpoints = Checkpoints(accelerator, output, keep=args.keep_checkpoints)
resume_from = checkpoints.resolve(args.resume)  # None: a fresh start
# ---- resume: weights, optimizer, schedule, RNG states and position, all from save_state's folder
state = RunState(accelerator.device, LOSS_NAMES)
# save_state / load_state carry the position with the weights
accelerator.register_for_checkpointing(state)
if resume_from is not None:
checkpoints.check_compatible(resume_from, config)
accelerator.load_state(resume_from)
accelerator.init_trackers(args.project, config=config, init_kwargs=tracking.init_kwargs_for(resume_from))
best = BestModel(accelerator, state, output, METRIC, patience=args.early_stopping_patience)
progress = training_progress(accelerator, args, state, best, resume_from, length)
guard = progress.guard  # stops on a non-finite loss or gradient or a stop signal, agreed by all
# ---- training loop
while state.epoch < length.epochs and not progress.finished:
progress.start_epoch()
model.train()
batches = epoch_batches(accelerator, train_loader, state.epoch, SKIPPED)
for BATCH in batches:
state.batches_done += 1
# skips the gradient all-reduce on accumulation micro-steps
with accelerator.accumulate(model):
accelerator.backward(loss)
# a non-finite loss is noted on the device, read at the next log step
guard.observe(loss)
if accelerator.sync_gradients:
grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm(args))
# --skip_nonfinite_steps drops a non-finite one
if keeps_update(progress, grad_norm):
optimizer.step()
optimizer.zero_grad(set_to_none=True)
if not accelerator.sync_gradients:
continue
scheduler.step()
if progress.step_done(scheduler):  # logs at log steps; True when a checkpoint is due
with saving_checkpoint(checkpoints, progress, config) as folder:
accelerator.save_state(folder)
if progress.finished:
break
# ---- evaluation once per epoch, on the whole validation split
# nothing non-finite since the last log step, before evaluating and saving
guard.check(state.step)
seconds = progress.epoch_done(state.last_eval)
if best.judge(state.last_eval):  # the best so far: saved to output_dir/model_best
with best.saving() as folder:
state.epoch, state.batches_done = state.epoch + 1, 0
with saving_checkpoint(checkpoints, progress, config) as folder:
accelerator.save_state(folder)
progress.close()
# ---- save the model and the run's results
accelerator.wait_for_everyone()
results = dict(config, **progress.results(started))
path = finish_run(accelerator, output, results)
if accelerator.is_main_process:
"""

# The modes main() may name besides training, each served by a function of the flags: the modes
# module's (or chat.modes'), evaluate_saved_model taking the recipe's own evaluate.
MODES = {"predict", "eval_only", "export", "chat", "merge", "plan_only"}

# What differs between recipes by design, mapped onto SKELETON's placeholders.
NORMALISE = (
    # a call ruff format wraps reads as the one-line call
    (
        r"setup_tracker\(\s*args\.tracker, output, args\.run_name or .+?, args\.swanlab_mode\s*\)",
        "setup_tracker(args.tracker, output, args.run_name or RUN_NAME, args.swanlab_mode)",
    ),
    (r"RunState\(accelerator\.device(, [\w.]+)?\)", "RunState(accelerator.device, LOSS_NAMES)"),
    (
        r"BestModel\(\s*accelerator, state, output, [^,]+, (higher_is_better=\w+, )?patience=(.+?)\s*\)\n",
        r"BestModel(accelerator, state, output, METRIC, patience=\2)\n",
    ),
    # The chat recipes read a step's micro-batches before its first forward pass (SFT: the loss is
    # the mean over the step's answer tokens), so accelerate must sync by count, and their epochs
    # are whole steps; cifar passes its --compile backend.
    (
        r"training_accelerator\(args, tracking(, steps_by_count=True|, dynamo_backend=\w+)\)",
        "training_accelerator(args, tracking)",
    ),
    # GRPO skips loader batches of prompts, not micro-batches (each gives --num_iterations updates).
    (
        r"epoch_batches\(accelerator, train_loader, state\.epoch, (state\.batches_done|done)\)",
        "epoch_batches(accelerator, train_loader, state.epoch, SKIPPED)",
    ),
    (r"for [\w, ]+ in (progress\.timed\(batches\)|batches):.*", "for BATCH in batches:"),
    (r"progress\.epoch_done\(state\.last_eval, .+\)", "progress.epoch_done(state.last_eval)"),
)


def lines_of(source: str) -> list[str]:
    """Stripped non-blank lines."""
    return [line.strip() for line in source.splitlines() if line.strip()]


def function_source(path, name: str) -> str:
    source = path.read_text()
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert node is not None, f"{path.name} has no function {name}()"
    return ast.get_source_segment(source, node)


def one_line_statements(source: str) -> str:
    """The source with each statement the formatter wrapped over several lines written on one line
    (the comments inside it dropped, a trailing comma before the closing bracket too), as SKELETON
    writes them."""
    lines = source.splitlines()
    spans, start = [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            continue
        if start is None:
            start = token.start[0]
        if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if token.start[0] > start and lines[start - 1].rstrip().endswith(("(", "[", "{")):
                spans.append((start, token.start[0]))
            start = None
    for first, last in reversed(spans):
        parts = [lines[first - 1].rstrip()]
        for line in lines[first:last]:
            line = line.strip()
            if line and not line.startswith("#"):
                sep = "" if parts[-1].endswith(("(", "[", "{")) or line[0] in ")]}" else " "
                parts.append(sep + line)
        joined = re.sub(r",(\s*[)\]}])", r"\1", "".join(parts))
        lines[first - 1 : last] = [joined]
    return "\n".join(lines) + "\n"


def expected_lines(text: str) -> list[str]:
    """SKELETON's lines, each statement on one line as normalised() writes a recipe's."""
    return lines_of(one_line_statements(text))


def normalised(source: str) -> list[str]:
    source = one_line_statements(source)
    for pattern, common in NORMALISE:
        source = re.sub(pattern, common, source)
    return lines_of(source)


def missing_in_order(expected: list[str], actual: list[str]) -> list[str]:
    """The lines of `expected` that `actual` does not hold in that order (a subsequence match)."""
    missing, position = [], 0
    for line in expected:
        try:
            position = actual.index(line, position) + 1
        except ValueError:
            missing.append(line)
    return missing


def code_lines(source: str) -> int:
    """Lines holding code: no blank, comment-only or docstring lines."""
    tree = ast.parse(source)
    doc_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            doc = node.body[0]
            doc_lines.update(range(doc.lineno, doc.end_lineno + 1))
    code = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (
            tokenize.COMMENT,
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            code.update(line for line in range(token.start[0], token.end[0] + 1) if line not in doc_lines)
    return len(code)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_training_function_holds_the_shared_skeleton(recipe):
    actual = normalised(function_source(RECIPES[recipe], "train"))
    assert not missing_in_order(expected_lines(SKELETON), actual), (
        f"{recipe}'s train() departs from the skeleton every recipe shares; make the same change in all "
        "recipes and in SKELETON, or keep the recipe's own lines outside it. Missing or out of order:\n"
        + "\n".join(missing_in_order(expected_lines(SKELETON), actual))
    )


def modes_module(recipe: str):
    """Where a recipe's modes other than training live: beside it, `<recipe>_modes.py`, or the
    detector folder's modes.py."""
    script = RECIPES[recipe]
    return script.parent / ("modes.py" if script.name == "train.py" else f"{script.stem}_modes.py")


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_function_per_mode_behind_the_same_main(recipe):
    """main() names its modes in one dict, flag -> function, and hands it to run_mode, which runs
    the one a flag names (two stop with one line) or trains."""
    node = ast.parse(function_source(RECIPES[recipe], "main")).body[0]
    docstring, table, call = node.body
    assert isinstance(docstring.value, ast.Constant) and isinstance(table, ast.Assign), ast.dump(node)
    assert ast.unparse(call) == "return run_mode(args, modes, otherwise=train)", ast.unparse(call)
    assert ast.unparse(table.targets[0]) == "modes" and isinstance(table.value, ast.Dict)
    named = dict(zip((key.value for key in table.value.keys), table.value.values))
    assert {"predict", "eval_only"} <= set(named) <= MODES, set(named)
    for flag, function in named.items():
        if flag == "eval_only":
            assert ast.unparse(function) == "lambda flags: evaluate_saved_model(flags, evaluate)"
        else:  # a function of the flags, imported from where the recipe's modes live
            assert isinstance(function, ast.Name), ast.unparse(function)
            assert re.search(
                rf"^from (chat\.modes|{modes_module(recipe).stem}) import [^\n]*\b{function.id}\b",
                RECIPES[recipe].read_text(),
                re.M,
            ), function.id
    function_source(RECIPES[recipe], "train")
    modes = modes_module(recipe)
    assert re.search(
        rf"^from {modes.stem} import [^\n]*\bevaluate_saved_model\b", RECIPES[recipe].read_text(), re.M
    )
    function_source(modes, "evaluate_saved_model")
    if recipe in CHAT_RECIPES:  # the chat recipes share theirs (and --chat, --merge)
        assert re.search(r"^from chat\.modes import [^\n]*\bpredict\b", RECIPES[recipe].read_text(), re.M)
        function_source(REPO / "recipes" / "chat" / "modes.py", "predict")
    else:
        function_source(modes, "predict")
    assert code_lines(function_source(RECIPES[recipe], "train")) <= 150


FLAGS_HEADER = (
    "from dataclasses import dataclass, field\nfrom typing import Literal\n"
    "from accelerate_recipes.flags import TrainingFlags"
)


def choice_names(tree: ast.Module) -> list[ast.stmt]:
    """The module's `Name = Literal[...]` statements, which its flag classes may annotate with."""
    return [
        n
        for n in tree.body
        if isinstance(n, ast.Assign)
        and isinstance(n.value, ast.Subscript)
        and ast.unparse(n.value.value) == "Literal"
    ]


def flags_class(recipe: str) -> type:
    namespace: dict = dict(chat_model_flag_classes()) if recipe in CHAT_RECIPES else {}
    tree = ast.parse(RECIPES[recipe].read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Flags"))
    module = ast.Module(
        body=ast.parse(FLAGS_HEADER).body + choice_names(tree) + [node],
        type_ignores=[],
    )
    exec(compile(module, str(RECIPES[recipe]), "exec"), namespace)
    return namespace[node.name]


@functools.cache
def chat_model_flag_classes() -> dict[str, type]:
    """recipes/chat/model.py's flag classes (ChatModelFlags, and KernelFlags that sft and dpo add),
    read as flags_class reads a recipe's (without importing torch)."""
    path = REPO / "recipes" / "chat/model.py"
    tree = ast.parse(path.read_text())
    nodes = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("ChatModelFlags", "KernelFlags")
    ]
    namespace: dict = {}
    body = ast.parse(FLAGS_HEADER).body + choice_names(tree) + nodes
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return {node.name: namespace[node.name] for node in nodes}


def chat_model_flags() -> type:
    return chat_model_flag_classes()["ChatModelFlags"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_flags_extend_the_shared_ones_without_changing_their_types(recipe):
    cls = flags_class(recipe)
    assert issubclass(cls, TrainingFlags) and dataclasses.is_dataclass(cls)
    shared, own = typing.get_type_hints(TrainingFlags), typing.get_type_hints(cls)
    changed = {name: (shared[name], own[name]) for name in shared if own[name] != shared[name]}
    assert not changed, f"{recipe} changes the type of shared flags: {changed}"
    # A shared flag is documented once, in TrainingFlags; a
    # recipe may document it anew, never copy that text.
    from accelerate_recipes.cli import parse_arg_docs

    _, shared_docs = parse_arg_docs(TrainingFlags.__doc__)
    if recipe in CHAT_RECIPES:  # nor the chat-model layer's
        assert issubclass(cls, chat_model_flags()), f"{recipe}'s flags do not extend ChatModelFlags"
        for shared_class in chat_model_flag_classes().values():
            shared_docs.update(parse_arg_docs(shared_class.__doc__)[1])
    _, own_docs = parse_arg_docs(cls.__doc__)
    copied = [name for name in shared_docs if own_docs.get(name) == shared_docs[name]]
    assert not copied, f"{recipe} repeats the shared help of {copied}: delete it there"
