# Two commands are all a learner needs:
#   make lab    install into .venv (created if missing) and open the course in JupyterLab
#   make test   install the same way and run the whole suite: unit tests, then every notebook
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: lab test install strip learner

# Jupyter refuses to run as root (containers, some cloud machines) unless told to.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(BIN)/jupyter lab $(LAB_ARGS) notebooks/

# Both cores (or all): pytest-xdist; a notebook's cells stay on one worker (conftest.py). Compiled-module caches
# on, where the environment turns them off (PYTHONDONTWRITEBYTECODE): the workers and the notebooks' kernels then
# compile the course's modules and pytest's rewritten tests once, not each in every process.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -n auto

install: $(STAMP)

# Reinstall only when the dependency list changes.
$(STAMP): requirements.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (found %s)" % sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -r requirements.txt
	touch $(STAMP)

# Notebooks are committed without outputs (tests/test_repo.py checks).
strip: $(STAMP)
	$(BIN)/nbstripout notebooks/*.ipynb

# Learner versions of the notebooks (solutions replaced by stubs) in learner/; your edits there are kept.
learner: $(STAMP)
	$(BIN)/python -m utils.course.learner
