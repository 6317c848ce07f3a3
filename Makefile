# Set-up and main jobs. `make demo` runs a local 3-daemon swarm; `make test` lints and runs every test.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build here; volunteers with GPUs use the Dockerfile or their own torch.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test lint unit bench bench-quick proto clean system-packages

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install --quiet $(TORCH_PIN)
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python scripts/demo_swarm.py

# Commit subjects: at most 72 characters from this commit on (older history is left as it was).
SUBJECTS_SINCE := 96cf8c1

lint: $(VENV)/.installed-test
	$(BIN)/ruff check crowdtrain tests scripts
	$(BIN)/ruff format --check crowdtrain tests scripts
	$(BIN)/mypy crowdtrain
	@if git rev-parse -q --verify $(SUBJECTS_SINCE)^{commit} >/dev/null 2>&1; then \
		git log --format=%s $(SUBJECTS_SINCE)..HEAD | awk 'length > 72 { print "commit subject over 72 characters: " $$0; bad = 1 } END { exit bad }'; \
	fi

# The WAN lab's NAT routers need nftables; as root on Debian it is installed here (the lab needs root anyway).
system-packages:
	@if [ "$$(id -u)" = 0 ] && ! command -v nft >/dev/null 2>&1; then \
		command -v apt-get >/dev/null 2>&1 || { echo "the NAT lab needs nftables: install it"; exit 1; }; \
		apt-get install -y -qq nftables >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null && apt-get install -y -qq nftables >/dev/null; }; \
	fi

# When pytest dies mid-run (a signal prints no test name), the last line names the test that was running.
test: lint system-packages
	$(BIN)/python -m pytest -q --durations=15 || { code=$$?; \
		echo "pytest exited with status $$code; the last test it started: $$(cat .pytest-last-test 2>/dev/null)"; \
		exit $$code; }

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not swarm"

$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[bench]'
	touch $@

# Every benchmark (averaging, throughput, DHT, footprint, DMoE, training, real model on CPU) in WAN-lab namespaces
# and on loopback; tables on stdout, JSON + PNG per benchmark and summary.json in bench-results/. Needs root. See BENCHMARKS.md.
bench: $(VENV)/.installed-bench
	$(BIN)/python scripts/bench_all.py

# The same benchmarks reduced to about 9 minutes on 2 cores (target: under 10; see BENCHMARKS.md; bench_training left out).
bench-quick: $(VENV)/.installed-bench
	$(BIN)/python scripts/bench_all.py --quick

# Regenerate protobuf code after editing crowdtrain/proto/*.proto.
proto: $(VENV)/.installed
	cd crowdtrain/proto && ../../$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. *.proto

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
