"""Hybrid sharding (accelerate_configs/2node-hsdp.yaml) for real: FSDP2 on a 2-D device mesh over 4
gloo processes, two "nodes" of two on 127.0.0.1 started by the hostfile launcher, as on two servers.
Each node shards the model over its own processes and the nodes hold replicas; the chat recipe
trains what one process trains (conftest's sft_one, with its flags) and saves the adapter whole. The
mesh's sizes are checked against the launch before anything starts."""

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from conftest import (
    CONFIGS,
    PYTHON,
    REPO,
    SFT_RUN,
    SFT_SCRIPT,
    check,
    fails_with,
    free_port,
    losses,
    read_results,
    recipe_env,
    run,
    sft_files,
)
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from accelerate_recipes.errors import RecipeError
from accelerate_recipes.sharding import check_hybrid_sharding

HSDP = CONFIGS / "2node-hsdp.yaml"
SCALING = REPO / "benchmarks" / "scaling.py"
ADAPTER = "adapter_model.safetensors"
# sft_one's run on 1 process and this one differ only in where the gradient sums happen (in one
# process, or a reduce-scatter within each node and an all-reduce across the nodes). Measured max
# difference over the 24 steps: 9.5e-7 (losses), 2.4e-7 (adapter). The tolerance of the suite's 1 vs
# 2 processes comparison (test_sft.py).
TOLERANCE = 1e-5


def without(flags: list, name: str) -> list:
    """`flags` less the flag `name` and its value."""
    at = flags.index(name)
    return flags[:at] + flags[at + 2 :]


@pytest.fixture(scope="module")
def hsdp_lora(tiny_chat_model, sft_data, module_tmp):
    """sft_one's run (a LoRA adapter, 2 epochs of 12 steps at a global batch of 8) on 2 nodes x 2
    processes under 2node-hsdp.yaml, its shard size set to the 2 processes of a node, as a user with
    2 GPUs per node sets it. Without the answers generated at evaluation (a sharded model refuses
    them), which change no trained number; with a sharded checkpoint at step 12, whose files show
    what each process held."""
    root = module_tmp.mktemp("hsdp")
    hosts = root / "hosts.txt"
    hosts.write_text("localhost slots=2\nlocalhost slots=2\n")
    out = root / "hsdp-lora"
    options = "--num_cpu_threads_per_process 1 --mixed_precision no --parallelism_config_dp_shard_size 2"
    launcher = [PYTHON, "-m", "recipe_tools.multinode", "--hostfile", hosts, "--config_file", HSDP]
    launcher += ["--main_process_port", free_port(), "--launch_args", options]
    flags = without(without(SFT_RUN, "--eval_generate"), "--checkpoint_every")
    args = [*sft_files(tiny_chat_model, sft_data), *flags, "--checkpoint_every", "12", "--output_dir", out]
    proc = check(run([*launcher, SFT_SCRIPT, *args], recipe_env(root, ACCELERATE_USE_CPU="true")))
    assert "all 2 node(s) finished" in proc.stdout
    return out


def assert_same_weights(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert worst <= TOLERANCE, worst


def test_hsdp_lora_trains_like_one_process_and_saves_the_whole_adapter(hsdp_lora, sft_one):
    results = read_results(hsdp_lora)
    assert results["distributed_type"] == "FSDP" and results["method"] == "lora"
    assert results["world_size"] == 4 and results["num_machines"] == 2 and results["steps"] == 24
    # --batch_size stays the global batch: 8 = 4 processes x 2 per process
    assert results["per_process_batch_size"] == 2
    ours, theirs = losses(hsdp_lora), losses(sft_one.out)
    assert sorted(ours) == sorted(theirs) == list(range(1, 25))
    worst = max(abs(ours[step] - theirs[step]) for step in ours)
    assert worst <= TOLERANCE, (worst, ours, theirs)
    assert ours[24] < ours[1] - 0.1, ours
    # The adapter gathered from the shards: every LoRA matrix of 7 linear layers x 2 blocks, whole.
    saved = load_file(hsdp_lora / ADAPTER)
    assert len(saved) == 28 and all("lora_" in key for key in saved)
    assert saved["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (8, 64)
    assert_same_weights(saved, load_file(sft_one.out / ADAPTER))
    assert results["best_step"] == read_results(sft_one.out)["best_step"]
    best = load_file(hsdp_lora / "model_best" / ADAPTER)
    assert_same_weights(best, load_file(sft_one.out / "model_best" / ADAPTER))
    # The memory plan divides the sharded parts by the 2 processes of a shard group, not by all 4.
    plan, whole = results["memory_plan_mb"], read_results(sft_one.out)["memory_plan_mb"]
    assert plan["gradients"] == pytest.approx(whole["gradients"] / 2)
    assert plan["optimizer"] == pytest.approx(whole["optimizer"] / 2)


@pytest.mark.parametrize("part", ["pytorch_model_fsdp_0", "optimizer_0"])
def test_each_node_holds_its_own_half_of_every_tensor(hsdp_lora, part):
    """The sharded checkpoint (torch.distributed.checkpoint) lists each tensor's distinct pieces and
    the rank that wrote each. Over 4 processes FSDP2 alone cuts every weight and AdamW state into 4
    quarters, one per rank; under HSDP each is cut into 2 halves (local rank 0 holds the first,
    local rank 1 the second), the same on both nodes, so the checkpoint keeps each half once,
    written by a rank of either node holding it."""
    metadata = FileSystemReader(str(hsdp_lora / "checkpoints" / "step_00000012" / part)).read_metadata()
    writers = {}  # (tensor, offset along dim 0) -> the rank that wrote that piece
    for index, storage in metadata.storage_data.items():
        rank = int(storage.relative_path.removeprefix("__").split("_")[0])
        writers[index.fqn, tuple(index.offset or ())[:1]] = rank  # no offset: a scalar (the step)
    tensors = {n: m for n, m in metadata.state_dict_metadata.items() if len(getattr(m, "size", ())) >= 1}
    # the LoRA matrices at least (the model: its base weights too)
    assert len(tensors) >= 28, sorted(tensors)
    for name, meta in tensors.items():
        rows = meta.size[0]
        pieces = sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)
        assert [(o[0], s[0]) for o, s in pieces] == [(0, rows // 2), (rows // 2, rows // 2)], (name, pieces)
        assert all(tuple(s[1:]) == tuple(meta.size[1:]) for _, s in pieces), (name, pieces)
        for shard, (offsets, _) in enumerate(pieces):
            assert writers[name, offsets[:1]] % 2 == shard, (name, offsets, writers[name, offsets[:1]])
    assert {rank // 2 for rank in writers.values()} == {0, 1}  # both nodes held (and wrote) pieces


def test_the_config_shards_within_each_node_and_replicates_across_the_nodes():
    config = load_config_from_file(str(HSDP))
    mesh = config.parallelism_config
    assert config.distributed_type.value == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    replicate, shard = mesh["parallelism_config_dp_replicate_size"], mesh["parallelism_config_dp_shard_size"]
    assert (replicate, shard * replicate) == (config.num_machines, config.num_processes) == (2, 16)
    assert "main_process_ip" not in yaml.safe_load(HSDP.read_text())


def launched(monkeypatch, world: int, local: int, **sizes) -> None:
    """The variables `accelerate launch` (torchrun) and a parallelism_config give each process."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
        monkeypatch.setenv(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", str(sizes.get(name, 1)))


@pytest.mark.parametrize(
    "world, local, sizes, fragments",
    [
        (4, 2, dict(dp_replicate=2, dp_shard=8), ["dp_shard_size 8 = 16 processes, but 4 were launched"]),
        (8, 2, dict(dp_replicate=2, dp_shard=4), ["dp_shard_size 4 does not divide the 2 process(es)"]),
        (4, 2, dict(dp_replicate=4, dp_shard=1), ["dp_shard_size 1", "shards nothing"]),
        (4, 2, dict(dp_replicate=1, dp_shard=2, tp=2), ["sets tp_size 2", "data parallel only"]),
    ],
)
def test_a_mesh_that_does_not_fit_stops_with_sizes_that_fit(monkeypatch, world, local, sizes, fragments):
    launched(monkeypatch, world, local, **sizes)
    with pytest.raises(RecipeError) as stop:
        check_hybrid_sharding()
    message = str(stop.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    nodes = world // local
    fix = f"--parallelism_config_dp_replicate_size {nodes} --parallelism_config_dp_shard_size {local}"
    assert f"for {nodes} node(s) x {local} process(es) launch with {fix}" in message


# processes, per node, replicas, shards
FITTING = [(4, 2, 2, 2), (16, 8, 2, 8), (8, 8, 2, 4), (8, 4, 1, 8)]


@pytest.mark.parametrize("world, local, replicate, shard", FITTING)
def test_a_mesh_of_whole_nodes_starts(monkeypatch, world, local, replicate, shard):
    """2 nodes x 2 or x 8 processes, two replicas of 4 on one node, and FSDP over all 8 processes of
    2 nodes (one replica: what fsdp.yaml does)."""
    launched(monkeypatch, world, local, dp_replicate=replicate, dp_shard=shard)
    check_hybrid_sharding()


# ------------------------------------------------------------- the layouts of benchmarks/scaling.py
QWEN_7B = 7_615_616_512  # parameters of Qwen2.5-7B, as docs/multinode.md works its traffic out for
LORA_7B = 40_370_176  # a LoRA adapter of rank 16 on its 7 linear layers x 28 blocks


def test_each_layouts_traffic_is_the_ring_arithmetic_the_guide_works_out():
    """2 nodes x 8 GPUs in bf16: DDP all-reduces fp32 gradients over all 16 processes, FSDP
    all-gathers the bf16 weights twice a micro-batch and reduce-scatters bf16 gradients over all 16,
    HSDP does that over the 8 of a node and all-reduces the gradients across the 2 nodes; the
    figures of docs/multinode.md's table."""
    from scaling import layout_traffic, size

    def traffic(name, shard, trainable, micro_batches=1):
        row = dict(num_machines=2, world_size=16, mixed_precision="bf16", parameters=QWEN_7B)
        row.update(trainable_parameters=trainable, gradient_accumulation_steps=micro_batches)
        return layout_traffic(dict(row, layout={"name": name, "shard": shard}))

    ddp, fsdp, hsdp = traffic("ddp", 1, QWEN_7B), traffic("fsdp", 16, QWEN_7B), traffic("hsdp", 8, QWEN_7B)
    assert ddp["network"] == pytest.approx(2 * 15 / 16 * 4 * QWEN_7B)
    assert fsdp["network"] == fsdp["within_node"] == pytest.approx(15 / 16 * (2 * 2 + 2) * QWEN_7B)
    assert hsdp["network"] == pytest.approx(2 * 1 / 2 * 2 * QWEN_7B)
    assert hsdp["within_node"] == pytest.approx(7 / 8 * (2 * 2 + 2) * QWEN_7B)
    assert [size(t["network"]) for t in (ddp, fsdp, hsdp)] == ["57.1 GB", "42.8 GB", "15.2 GB"]
    layouts = (("ddp", 1), ("fsdp", 16), ("hsdp", 8))
    lora = [size(traffic(name, shard, LORA_7B)["network"]) for name, shard in layouts]
    assert lora == ["303 MB", "28.6 GB", "80.7 MB"]
    # Micro-batches gather FSDP's weights again each
    # time; HSDP's network share is the gradients' alone.
    assert size(traffic("fsdp", 16, QWEN_7B, micro_batches=4)["network"]) == "129 GB"
    assert traffic("hsdp", 8, QWEN_7B, micro_batches=4)["network"] == hsdp["network"]


def test_layouts_that_do_not_exist_are_named(tmp_path):
    command = [PYTHON, SCALING, "run", "--layouts", "ddp,zero3", "--main_process_ip", "127.0.0.1"]
    fails_with(run(command, recipe_env(tmp_path)), "--layouts ddp,zero3: use some of ddp,fsdp,hsdp")
