#!/usr/bin/env bash
# Regenerate the Python code for protos/simsearch/v1/*.proto into OUT (default: the repo).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python -m grpc_tools.protoc -I. --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/simsearch/v1/*.proto
