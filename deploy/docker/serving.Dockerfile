# Search server: ONNX Runtime + faiss + gRPC, no torch. Model and index are mounted as volumes.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md requirements.lock ./
COPY core/ core/
COPY index/ index/
COPY serving/ serving/
COPY protos/ protos/
COPY simsearch/ simsearch/
COPY deploy/healthcheck.py deploy/healthcheck.py
# Base dependencies only (no `train` extra): a serving image carries no torch. At the lock's pins
# (python:3.11 on x86_64, what the lock was resolved for).
RUN pip install --no-cache-dir -c requirements.lock . && useradd --uid 10001 --create-home simsearch
USER 10001
VOLUME ["/models", "/indexes"]
EXPOSE 50051 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 CMD ["python", "deploy/healthcheck.py", "127.0.0.1:50051"]
ENTRYPOINT ["python", "-m", "serving", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]
CMD ["--index-root", "/indexes", "--watch-current"]
