"""The net under the compiled paths (accelerate_recipes/compiling.py): a compiled default that
cannot compile goes on eagerly with one line that names the cause and the flags, and the call that
failed is made again eagerly; an explicit --compile (or --decode compiled) makes the same failure a
one-line error.

In process, on the tiny chat model: the decoder blocks under a backend that raises and under torch's
recompile limit, a missing compiler found before the first step, the compiled decode under a backend
that raises; the results.json counts; and the command line's one line for a compilation asked for
that fails. The recipes' compiled runs on the CPU (their GPU shape with the aot_eager backend) are
in test_sft.py and test_dpo.py.
"""

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from chat import model as chat_model
from chat.generation import decode_path, decodes_compiled, greedy_ids, use_decode_backend
from conftest import PYTHON, SFT_COMMON, SFT_SCRIPT, fails_with, recipe_env, run, sft_files
from transformers import AutoModelForCausalLM, GenerationConfig

from accelerate_recipes.compiling import (
    CompiledPath,
    compile_failure,
    compile_results,
    missing_toolchain,
    process_compile_counts,
)
from accelerate_recipes.errors import RecipeError

ON_A_GPU = SimpleNamespace(device=torch.device("cuda"), distributed_type=DistributedType.NO, print=print)


def broken_backend(graph, example_inputs):
    raise RuntimeError("no kernels for this graph")


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Every test compiles from nothing and leaves torch's settings as it found them."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=False):
        yield
    torch._dynamo.reset()


def blocks_path(explicit: bool = False) -> CompiledPath:
    return CompiledPath("the decoder blocks", "--nocompile", "--compile", explicit=explicit)


def train_steps(model, widths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Optimizer steps on random rows of the given widths; each step's loss."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for width in widths:
        ids = torch.randint(0, model.config.vocab_size, (2, width), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def tiny(folder):
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.config.use_cache = False  # as the recipes train
    return model


def stderr_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if "run eagerly" in line]


def test_a_backend_that_fails_sends_every_block_back_to_eager_and_the_step_trains_as_eager(
    tiny_chat_model, capfd
):
    widths = [17, 23, 17]
    expected = train_steps(tiny(tiny_chat_model), widths)
    model, path = tiny(tiny_chat_model), blocks_path()
    chat_model.compile_blocks(model, broken_backend, path)
    losses = train_steps(model, widths)
    # eager, as eager
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=0, atol=0)
    assert all(block._compiled_call_impl is None for block in model.model.layers)
    assert path.eager and "RuntimeError: no kernels for this graph" in path.fallback
    [line] = stderr_lines(capfd)  # said once, for the run
    assert line.startswith("the decoder blocks run eagerly: BackendCompilerFailed")
    assert "--nocompile skips the attempt, --compile makes it an error" in line
    figures = path.figures("compile", "compile_seconds")
    assert figures["compile_fallback"] == path.fallback and figures["compile_graphs"] == 0

    # given --compile, the same failure is an error, in one line
    model = tiny(tiny_chat_model)
    chat_model.compile_blocks(model, broken_backend, blocks_path(explicit=True))
    with pytest.raises(RecipeError) as error:
        train_steps(model, widths[:1])
    assert "\n" not in str(error.value) and str(error.value).startswith(
        "--compile: the decoder blocks could not"
    )
    assert "no kernels for this graph" in str(error.value) and "run without --compile" in str(error.value)


def test_the_recompile_limit_sends_the_blocks_back_to_eager_instead_of_a_silent_slow_run(
    tiny_chat_model, capfd
):
    """torch recompiles a code object at most recompile_limit times and then runs it eagerly without
    a word; here the limit (1) is reached at the second graph (an evaluation without gradients
    between training steps of other widths) and said, and every later step runs eagerly."""

    def train_evaluate_train(model) -> list[torch.Tensor]:
        losses = train_steps(model, [17])
        with torch.no_grad():
            ids = torch.arange(23).remainder(model.config.vocab_size).unsqueeze(0)
            losses.append(model(input_ids=ids, labels=ids).loss)
        return losses + train_steps(model, [29, 31], seed=1)

    expected = train_evaluate_train(tiny(tiny_chat_model))
    model, path = tiny(tiny_chat_model), blocks_path()
    chat_model.compile_blocks(model, "aot_eager", path)
    with torch._dynamo.config.patch(recompile_limit=1):
        losses = train_evaluate_train(model)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
    assert path.counts.graphs >= 1 and "recompile limit (1 graphs of one function)" in path.fallback
    [line] = stderr_lines(capfd)
    assert "recompile limit" in line and "\n" not in line


def test_a_missing_compiler_is_found_before_the_first_step(
    tiny_chat_model, sft_data, tmp_path, monkeypatch, capfd
):
    """Without a C compiler inductor cannot build Triton's launcher on a GPU (nor its C++ kernels on
    a CPU): by default the blocks then run eagerly from the first step, said in one line; given
    --compile, a one-line error. No compiler found: a PATH with none on it, as on a slim image."""
    from sft import SftFlags
    from sft_data import launch_flags

    # this machine has both
    assert missing_toolchain("cuda") is None and missing_toolchain("cpu") is None
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert "no C compiler for Triton" in missing_toolchain("cuda")
    assert "no C++ compiler for inductor" in missing_toolchain("cpu")
    assert missing_toolchain("cpu", backend="aot_eager") is None  # generates no code

    args, blocks = launch_flags(SftFlags(), ON_A_GPU)  # the default on a GPU: compiled
    assert args.compile is False and blocks.eager and "no C compiler" in blocks.fallback
    [line] = stderr_lines(capfd)
    assert line.startswith("the decoder blocks run eagerly: no C compiler for Triton (set CC")
    with pytest.raises(RecipeError, match="^--compile: the decoder blocks could not compile .no C compiler"):
        launch_flags(SftFlags(compile=True), ON_A_GPU)

    # the recipe as a user starts it on this CPU with --compile (inductor) and no C++ compiler: one
    # line, no traceback
    monkeypatch.undo()
    env = recipe_env(tmp_path, CXX=str(tmp_path / "no-such-g++"))
    cmd = [PYTHON, SFT_SCRIPT, *sft_files(tiny_chat_model, sft_data), *SFT_COMMON, "--compile"]
    proc = run([*cmd, "--output_dir", tmp_path / "out"], env, timeout=300)
    line = fails_with(proc, "--compile: the decoder blocks could not compile (no C++ compiler for inductor")
    assert "Traceback" not in proc.stderr and "apt-get install g++" in line


def test_a_compiled_decode_that_fails_decodes_eagerly_the_same_tokens(tiny_chat_model, capfd):
    """The compiled decode step under a backend that raises: the call decodes eagerly (the same
    greedy tokens as an eager decode), the fast decoder's copy and caches are freed, and later calls
    stay eager without a word more; with --decode compiled the same failure is an error."""
    from chat.generation import _fast_decoders

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model).eval()
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=[1])
    expected = greedy_ids(model, ids, mask, config, "eager", torch.float32)

    use_decode_backend(model, broken_backend)
    assert decodes_compiled(model, "auto", "cpu")  # auto chose the compiled decode, as on a GPU
    for _ in range(2):
        assert torch.equal(greedy_ids(model, ids, mask, config, "compiled", torch.float32), expected)
    path = decode_path(model)
    assert path.eager and not path.explicit and "no kernels for this graph" in path.fallback
    assert model not in _fast_decoders
    [line] = stderr_lines(capfd)
    assert line.startswith("the decode step run eagerly: BackendCompilerFailed")
    assert "--decode eager skips the attempt, --decode compiled makes it an error" in line

    other = AutoModelForCausalLM.from_pretrained(tiny_chat_model).eval()
    use_decode_backend(other, broken_backend)
    with pytest.raises(RecipeError, match="^--decode compiled: the decode step could not compile"):
        # compiled without auto: asked for
        greedy_ids(other, ids, mask, config, "compiled", torch.float32)


def test_what_counts_as_a_compile_failure_and_what_is_counted():
    capture = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    assert compile_failure(capture) and compile_failure(RuntimeError("cudaGraph replay failed"))
    assert not compile_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not compile_failure(torch.OutOfMemoryError("CUDA out of memory"))

    before = process_compile_counts()
    compiled = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")
    # a static graph, then one dynamic in the size: two, the second a recompile
    for size in (3, 4, 5, 6):
        compiled(torch.randn(size))
    counts = process_compile_counts() - before
    assert (counts.graphs, counts.recompiles) == (2, 1) and counts.seconds > 0
    figures = compile_results(before)
    assert (figures["compile_graphs"], figures["compile_recompiles"], figures["compile_fallback"]) == (
        2,
        1,
        None,
    )


def test_the_command_line_turns_a_failed_compilation_into_one_line(tmp_path):
    """A compilation the user asked for (cifar --compile, a launcher's --dynamo_backend) that fails
    ends the run with one line naming the cause, not dynamo's traceback."""
    script = tmp_path / "compiles.py"
    script.write_text(
        "import torch\nfrom accelerate_recipes import run\n\n"
        "def broken(graph, inputs):\n"
        "    raise RuntimeError('no kernels for this graph')\n\n"
        "def main(size: int = 3):\n"
        "    torch.compile(lambda x: x.sin(), backend=broken)(torch.ones(size))\n\n"
        "if __name__ == '__main__':\n"
        "    run(main)\n"
    )
    proc = run([PYTHON, script], recipe_env(tmp_path), timeout=120)
    line = fails_with(proc, "error: torch.compile failed (BackendCompilerFailed: RuntimeError: no kernels")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "run without --compile" in line
