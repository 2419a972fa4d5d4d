# Training, export and index building (torch, Ray Train/Data, ONNX, faiss) plus the glyph fonts.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
      fonts-noto-core fonts-urw-base35 fonts-liberation fonts-liberation2 fonts-freefont-ttf fonts-texgyre \
      fonts-lato fonts-open-sans fonts-roboto-unhinted fonts-crosextra-carlito fonts-crosextra-caladea \
      fonts-linuxlibertine fonts-ebgaramond fonts-cantarell \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md requirements.lock ./
COPY training/ training/
COPY core/ core/
COPY index/ index/
COPY serving/ serving/
COPY protos/ protos/
COPY simsearch/ simsearch/
COPY scripts/ scripts/
# At the lock's pins (python:3.11 on x86_64, what the lock was resolved for).
RUN pip install --no-cache-dir -c requirements.lock "torch==2.14.1" "torchvision==0.29.1" \
    && pip install --no-cache-dir -c requirements.lock ".[train]" \
    && useradd --uid 10001 --create-home simsearch
USER 10001
VOLUME ["/data", "/runs"]
ENV SIMSEARCH_DATA=/data
ENTRYPOINT ["python", "-m"]
CMD ["training", "train", "--out", "/runs/train"]
