#!/usr/bin/env bash
# The GPU path in one script, for a lent CUDA machine that has torch but no megatron-core,
# vLLM or Transformer Engine: installs the carried megatron-core wheel, runs the CUDA tests
# (fp32 and bf16 forward and backward against the CPU path, MiMo and the MoE families; a
# bf16 training step over a one-rank NCCL group with megatron-core DDP and its optimizer)
# and prints one table.
# Where no GPU answers it says so and exits 0 having run nothing.
#
#   bash gpu_check.sh --fetch   # here, with PyPI: the Python 3.12 wheel into .whl/ (git-ignored)
#   bash gpu_check.sh           # there, with .whl carried: about 2 minutes on an H200, up to 6 more
#                               # while GLM-4.5's MoE test times out (docs/GPU.md)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

MEGATRON_CORE=megatron-core==0.16.1
WHEEL_DIR=.whl
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = --fetch ]; then
  grep -qx "/$WHEEL_DIR/" .git/info/exclude 2>/dev/null || echo "/$WHEEL_DIR/" >> .git/info/exclude
  exec "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$WHEEL_DIR" "$MEGATRON_CORE"
fi

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check.sh: no GPU here ('$PYTHON' has no torch with a CUDA device); nothing was run"
  exit 0
fi

if ! "$PYTHON" -c 'import megatron.core' 2>/dev/null; then
  ls "$WHEEL_DIR"/megatron_core-*.whl >/dev/null 2>&1 \
    || { echo "gpu_check.sh: megatron-core is not installed and no wheel is in $WHEEL_DIR/ (bash gpu_check.sh --fetch)" >&2; exit 1; }
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/gpu-check-site \
    "$WHEEL_DIR"/megatron_core-*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi

# The CUDA tests import no vLLM: block it, so a stray import fails here, not in a user's hands.
log=$(mktemp -d)/cuda-tests.xml
PYTHONUNBUFFERED=1 "$PYTHON" - "$log" <<'PY'
import subprocess, sys
sys.modules["vllm"] = None
import test_all  # noqa: F401  (imports without vLLM, or this fails)
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "test_all.py", "-k", "cuda", "-q", "-p", "no:cacheprovider",
                          "-o", "junit_logging=system-out", f"--junitxml={sys.argv[1]}"]))
PY
status=$?

"$PYTHON" - "$log" <<'PY'
import platform, sys, xml.etree.ElementTree as ET
import torch, megatron.core
print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
      f"megatron-core {megatron.core.__version__} | Python {platform.python_version()}\n")
print("| test | result | seconds | measured |\n|---|---|---|---|")
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    measured = " ".join(line.strip() for line in (case.findtext("system-out") or "").splitlines()
                        if " vs " in line or " over " in line)
    print(f"| {case.get('name')} | {outcome} | {float(case.get('time')):.1f} | {measured} |")
PY
exit $status
