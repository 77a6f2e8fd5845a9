# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench stress

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --stage 0

test: $(STAMP)
	$(PY) -m pytest -q

# zerofx beside DDP, FSDP2 and DeepSpeed on 2 and 4 gloo ranks, then a Hugging Face Llama on 2; writes
# benchmarks/results/peers-[llama-]<date>.{md,png,json}.
# torch is installed first and pinned, so DeepSpeed's dependency on torch cannot replace the CPU build.
bench: $(STAMP)
	$(PY) -m pip install -q torch==2.13.0 -e '.[bench]'
	$(PY) -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(PY) benchmarks/compare_peers.py --size default
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(PY) benchmarks/compare_peers.py --size default --model llama --worlds 2

# Stage 3 on 4 gloo ranks with a checkpoint save, 50 times in fresh processes: one line per run, then a summary.
stress: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/stress_checkpoint.py --runs 50
