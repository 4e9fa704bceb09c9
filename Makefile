# `make setup`: .venv with what the examples need, and the supervisor's command rpcrun.
# `make run`: every example end to end with small settings. `make test`: lint and tests.
# Both create .venv on first use and install into it what requirements.txt lists (`make test`:
# the newest releases it allows, pinned in requirements-newest.txt, so that CI is reproducible)
# and, editable, this project (pyproject.toml): rpc_harness, the supervisor, whose command is
# rpcrun. The examples import none of it. A requirements file or pyproject.toml that changed is
# reinstalled (stamp files).
# `make test-oldest`: on the oldest versions requirements.txt allows, in .venv-oldest
# (requirements-oldest.txt pins them), the quick tests, every entry point end to end once
# in each launch mode (tests/test_launch_modes.py), and the faults of real runs that make
# faults' matrix also runs (the tests marked faults).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OLDEST := .venv-oldest

.PHONY: setup run test test-quick test-oldest bench faults versions pictures docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.run-installed: requirements.txt pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt -e .
	touch $@

setup: $(VENV)/.run-installed

$(VENV)/.dev-installed: requirements-newest.txt requirements-dev.txt pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -r requirements-newest.txt -r requirements-dev.txt -e .
	touch $@

# pyproject.toml's addopts run the tests on two workers, a whole file each (pytest-xdist).
# make test leaves tests/test_launch_modes.py and the faults that make faults' matrix also runs
# to make test-oldest (pyproject.toml's launch_modes and faults markers say why).
test: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not launch_modes and not faults" --durations=25

test-quick: $(VENV)/.dev-installed
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow"

$(OLDEST)/bin/python:
	$(PYTHON) -m venv $(OLDEST)

$(OLDEST)/.installed: requirements-oldest.txt requirements-dev.txt pyproject.toml | $(OLDEST)/bin/python
	$(OLDEST)/bin/python -m pip install --quiet -r requirements-oldest.txt -r requirements-dev.txt -e .
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -m pytest -m "not slow"
	$(OLDEST)/bin/python -m pytest -m "launch_modes or faults"

# The tour: each program's README command, made shorter by flags only (batches, episodes,
# epochs, and where to write), the plain command, as a reader runs it; the last one under rpcrun.
# The parameter server trains on MNIST when it is in data/ or can be downloaded; otherwise
# main.py exits 2 before starting any rank, and the tour runs it on the synthetic digits.
# The Monarch programs exit 2 where Monarch has no wheel (Python 3.14, macOS), saying why: the
# tour goes on without them. Their tour flags are fixed, so a 2 can only mean that.
NO_MONARCH = { test $$? -eq 2 && echo "== skipped: Monarch is not installed here (the line above says why)"; }
PS_TOUR := --max_batches 60 --log_interval 20
run: $(VENV)/.run-installed
	@echo "== param_server: 1 parameter server, 2 trainers"
	@$(PY) param_server/main.py --world_size 3 --dataset mnist $(PS_TOUR) || { test $$? -eq 2 && \
	  echo "== param_server: MNIST unavailable, using --dataset synthetic" && \
	  $(PY) param_server/main.py --dataset synthetic --world_size 3 $(PS_TOUR); }
	@echo "== param_server/batch.py: the batch-updating server of the batch RPC tutorial, 3 trainers"
	@$(PY) param_server/batch.py --dataset synthetic --world_size 4 $(PS_TOUR)
	@echo "== param_server/actors.py: batch.py's server and 3 trainers as Monarch actors"
	@$(PY) param_server/actors.py --dataset synthetic --world_size 4 $(PS_TOUR) || $(NO_MONARCH)
	@echo "== rl_cartpole: an agent and 1 observer, then batch.py: 4 observers, batched actions"
	@$(PY) rl_cartpole/main.py --max_episodes 20
	@$(PY) rl_cartpole/batch.py --world_size 5 --max_episodes 20 --log_interval 10
	@echo "== rl_cartpole/actors.py: the agent and 1 observer as Monarch actors"
	@$(PY) rl_cartpole/actors.py --max_episodes 20 --log_interval 10 || $(NO_MONARCH)
	@echo "== rnn_model_parallel: embedding table and decoder on ps, LSTM on the trainer"
	@$(PY) rnn_model_parallel/main.py --epochs 3
	@echo "== rnn_model_parallel: the same model as a word-level language model on a text"
	@$(PY) rnn_model_parallel/main.py --corpus rnn_model_parallel/README.md --emsize 64 \
	  --nhid 64 --bptt 35 --batch_size 20 --epochs 5
	@echo "== ddp_rpc_hybrid: 2 trainers under DDP, a master, an EmbeddingBag on ps"
	@$(PY) ddp_rpc_hybrid/main.py --epochs 3
	@echo "== ddp_rpc_hybrid/remote_module.py: the same, the tutorial's 2021 revision (RemoteModule)"
	@$(PY) ddp_rpc_hybrid/remote_module.py --epochs 3
	@echo "== pipeline_parallel: ResNet-50 in two shards, 1 and then 4 micro-batches a batch"
	@$(PY) pipeline_parallel/main.py --num_split 1 4 --batch_size 16 --num_batches 3
	@echo "== pipeline_parallel/pipelining.py: the same with torch.distributed.pipelining"
	@$(PY) pipeline_parallel/pipelining.py --num_split 2 --batch_size 16 --lr 0.02 --num_batches 10
	@echo "== cuda_rpc: the CUDA RPC recipe's two workers (CPU tensors where there is no GPU)"
	@$(PY) cuda_rpc/main.py --iterations 3
	@echo "== rpc_profiling, under rpcrun: the recipe's RPCs, then both ranks profiled, one timeline in traces/"
	@$(PY) -m rpc_harness rpc_profiling/main.py --profile traces

# bench/RESULTS-<cores>-cores.md and its chart: RPC against one process, side by side, and
# bench/MONARCH-<cores>-cores.md with bench/scaling-<cores>-cores.png: the Monarch programs and
# Ray's parameter server beside the RPC ones (26 minutes on 2 cores; QUICK=1: one shorter
# repetition). SOLVE=1: instead, rl_cartpole trained until solved, three ways, into
# bench/SOLVE.md (17 minutes here; more when a run needs many episodes).
# Ray (bench/requirements-ray.txt) is installed for `make bench` alone: its parameter server
# is a row of the Monarch tables.
$(VENV)/.bench-installed: bench/requirements-ray.txt $(VENV)/.dev-installed
	$(PY) -m pip install --quiet -r bench/requirements-ray.txt
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) bench/bench.py $(if $(QUICK),--quick) $(if $(SOLVE),--solve)

# bench/FAULTS-<cores>-cores.md: every entry point in every launch mode under every fault a
# user can cause, each command under rpcrun, and what each terminal showed (bench/faults.py;
# over an hour on 2 cores: 175 of its 340 cells took 37 minutes). Each cell is recorded as it
# ends (bench/faults-<cores>-cores.json): Ctrl-C stops it, and the next `make faults` picks up
# where it stopped. AGAIN=1: every cell again. PLAIN=1: the same with the plain commands, torch alone, into
# bench/FAULTS-plain-torch<minor>-<cores>-cores.md; TORCH=oldest: on the oldest torch that
# requirements.txt allows (.venv-oldest), as docs/failures.md shows both. QUICK=1: param_server's
# main.py and actors.py alone, every mode and fault (8 minutes). The pages and docs/failures.md's
# measured tables are written from the record.
FAULTS_PY := $(if $(filter oldest,$(TORCH)),$(OLDEST)/bin/python,$(PY))
faults: $(VENV)/.dev-installed $(if $(filter oldest,$(TORCH)),$(OLDEST)/.installed)
	$(FAULTS_PY) bench/faults.py $(if $(QUICK),--quick) $(if $(PLAIN),--plain) $(if $(AGAIN),--again)

# docs/versions.md: every entry point in every launch mode on each torch minor from
# requirements.txt's floor to the newest release, and on each Python that pyproject.toml claims,
# each in an environment of its own that uv makes and removes (bench/versions.py; hours on 2
# cores, see docs/versions.md's head). Ctrl-C stops it; run it again to pick up where it stopped.
# Run it after a change to an example, to the supervisor or to a requirement.
$(VENV)/.versions-installed: bench/requirements-versions.txt $(VENV)/.dev-installed
	$(PY) -m pip install --quiet -r bench/requirements-versions.txt
	touch $@

versions: $(VENV)/.versions-installed
	$(PY) bench/versions.py

# The READMEs' pictures of a profiled run's timeline (bench/draw_timeline.py), from fresh runs
# under rpcrun, which merges the ranks' traces into $dir/timeline.json: each example's step 4
# (of its first looping rank), and the recipe's two RPCs. PICTURE's arguments: folder, flags,
# drawing flags, and where not main.py and timeline.png, script, picture.
PICTURE = dir=$$(mktemp -d) && trap 'rm -r "$$dir"' EXIT && \
	  $(PY) -m rpc_harness $(1)/$(or $(strip $(4)),main.py) $(2) --profile $$dir > $$dir/run.log && \
	  $(PY) bench/draw_timeline.py $$dir/timeline.json $(1)/$(or $(strip $(5)),timeline.png) $(3) && \
	  grep -E "wrote|Wrote" $$dir/run.log
pictures: $(VENV)/.dev-installed
	@$(call PICTURE,param_server,--dataset synthetic --world_size 3 --max_batches 8,--step "ProfilerStep#3" \
	  --title "param_server: trainer_1's step 4 (the server runs the model for both trainers: forward on RPC threads and backward on autograd threads)")
	@$(call PICTURE,rl_cartpole,--max_episodes 6,--step "ProfilerStep#3" \
	  --title "rl_cartpole: the agent's episode 4 (each select_action call of observer1 runs on an RPC thread)")
	@$(call PICTURE,rnn_model_parallel,--epochs 1,--step "ProfilerStep#3" \
	  --title "rnn_model_parallel: the trainer's step 4 (ps runs the embedding and the decoder: forward and backward)")
	@$(call PICTURE,ddp_rpc_hybrid,--epochs 1,--step "ProfilerStep#3" \
	  --title "ddp_rpc_hybrid: trainer0's step 4 (its loop runs on an RPC thread; Gloo averages the Linear's gradients)")
	@$(call PICTURE,pipeline_parallel,--num_split 4 --batch_size 16 --num_batches 6,\
	  --step "ProfilerStep#3" --title "pipeline_parallel: the master's step 4 (4 micro-batches: shard 1 on worker1 and shard 2 on worker2)")
	@$(call PICTURE,pipeline_parallel,--schedule GPipe --num_split 4 --batch_size 16 --num_batches 6,\
	  --step "ProfilerStep#3" --title "pipeline_parallel/pipelining.py: step 4 of both stages (GPipe: 4 micro-batches forward and then 4 backward)",\
	  pipelining.py,timeline-pipelining.png)
	@$(call PICTURE,rpc_profiling,,--first "rpc_async#aten::add" --last "rpc_async#aten::mul" \
	  --title "rpc_profiling: worker0's add and mul RPCs and worker1's RPC thread running them")

# The READMEs' sample outputs, run again, and their links to lines of code pointed again
# (docs/make_docs.py). LINKS=1: the links only, which runs nothing.
docs: $(VENV)/.dev-installed
	$(PY) docs/make_docs.py $(if $(LINKS),--links-only)

clean:
	rm -rf $(VENV) $(OLDEST) .pytest_cache .ruff_cache
