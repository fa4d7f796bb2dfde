#!/usr/bin/env bash
# The wheels benchmarks/gpu/run.sh installs on the GPU machine, which has torch (CUDA), numpy,
# psutil, matplotlib and ninja but no package index: DeepSpeed (built here as a pure-Python
# wheel, its ops compiled at first use), megatron-core, hjson, pydantic with pydantic-core,
# annotated-types, typing-inspection and typing-extensions (pydantic needs a newer one than torch
# does), and pytest with its dependencies (the recovery test),
# each at the version the project's environment has installed, so that the GPU runs what CI
# tests. Binary wheels are for CPython 3.12 on x86-64 Linux.
#
#   benchmarks/gpu/wheels.sh [DIR]     fetch them into DIR (default .whl), replacing the wheels there
#   benchmarks/gpu/wheels.sh --pins    print NAME==VERSION of each, fetch nothing
#
# PYTHON: the project's environment (default .venv/bin/python, else python3).
set -euo pipefail

cd "$(dirname "$0")/../.."
PACKAGES=(deepspeed megatron-core hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
          pytest pluggy iniconfig pygments)
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python
fi

pins=$("$PYTHON" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"wheels.sh: {sys.executable} has no {', '.join(missing)} installed: set PYTHON to the project's environment")
EOF
)

if [[ "${1:-}" == "--pins" ]]; then
    echo "$pins"
    exit 0
fi
dir=${1:-.whl}
mkdir -p "$dir"
rm -f "$dir"/*.whl
deepspeed=$(grep '^deepspeed==' <<<"$pins")
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps "$deepspeed" -w "$dir"
# shellcheck disable=SC2046
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" $(grep -v '^deepspeed==' <<<"$pins")
count=$(find "$dir" -maxdepth 1 -type f -name '*.whl' | wc -l)
if (( count != ${#PACKAGES[@]} )); then
    echo "wheels.sh: $dir holds $count wheels, expected ${#PACKAGES[@]} (${PACKAGES[*]})" >&2
    exit 1
fi
ls "$dir"
