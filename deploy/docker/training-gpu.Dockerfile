# Training and index building on GPU workers: CUDA torch, onnxruntime-gpu, faiss GPU.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_BREAK_SYSTEM_PACKAGES=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip fonts-noto-core \
      fonts-urw-base35 fonts-liberation fonts-liberation2 fonts-freefont-ttf fonts-texgyre fonts-lato \
      fonts-open-sans fonts-roboto-unhinted fonts-crosextra-carlito fonts-crosextra-caladea \
      fonts-linuxlibertine fonts-ebgaramond fonts-cantarell \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY training/ training/
COPY core/ core/
COPY index/ index/
COPY serving/ serving/
COPY protos/ protos/
COPY simsearch/ simsearch/
COPY scripts/ scripts/
RUN pip3 install --no-cache-dir "torch==2.14.1" "torchvision==0.29.1" && pip3 install --no-cache-dir ".[train]" \
    && pip3 uninstall -y onnxruntime faiss-cpu \
    && pip3 install --no-cache-dir "onnxruntime-gpu>=1.18,<2" "faiss-gpu-cu12>=1.8,<2" \
    && useradd --uid 10001 --create-home simsearch
USER 10001
VOLUME ["/data", "/runs"]
ENV SIMSEARCH_DATA=/data
ENTRYPOINT ["python3", "-m"]
CMD ["training", "train", "--out", "/runs/train", "--device", "auto"]
