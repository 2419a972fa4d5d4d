#!/usr/bin/env bash
# Update requirements.lock on purpose: resolve every package the project installs at the newest
# versions pyproject.toml (and this machine's torch cap) allow, in a scratch venv, and pin each
# one. Then `make setup` moves .venv to the new pins; regenerate the gRPC code (`make protos`)
# when the lock moved grpcio-tools, and run `make test` before committing the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
VENV="$scratch/venv" LOCK=none bash scripts/setup.sh >&2
{
  echo "# Every package \`make setup\` installs, pinned (pip constraints). Update on purpose with \`make lock\`"
  echo "# (scripts/lock.sh), never by hand. Resolved for CPython $("$scratch/venv/bin/python" -c 'import platform; print(platform.python_version(), platform.machine())') on $(date -u +%F)."
  "$scratch/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -i "^simsearch\b" | LC_ALL=C sort -f
} > requirements.lock.new
mv requirements.lock.new requirements.lock
echo "wrote requirements.lock: $(grep -c '==' requirements.lock) packages pinned" >&2
