# Search server on GPU: onnxruntime-gpu (CUDA provider) and a faiss GPU build on a CUDA base.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_BREAK_SYSTEM_PACKAGES=1
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core/ core/
COPY index/ index/
COPY serving/ serving/
COPY protos/ protos/
COPY simsearch/ simsearch/
COPY deploy/healthcheck.py deploy/healthcheck.py
# The GPU builds replace the CPU wheels; the code picks CUDA when it sees a GPU.
RUN pip3 install --no-cache-dir . && pip3 uninstall -y onnxruntime faiss-cpu \
    && pip3 install --no-cache-dir "onnxruntime-gpu>=1.18,<2" "faiss-gpu-cu12>=1.8,<2" \
    && useradd --uid 10001 --create-home simsearch
USER 10001
VOLUME ["/models", "/indexes"]
EXPOSE 50051 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 CMD ["python3", "deploy/healthcheck.py", "127.0.0.1:50051"]
ENTRYPOINT ["python3", "-m", "serving", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100", "--provider", "auto"]
CMD ["--index-root", "/indexes", "--watch-current"]
