# Easel on the NGC Triton image (Triton 2.51 = 24.10, the same server version as nvidia-pytriton 0.7.0).
# Not built here: no Docker engine runs on our machines (see README).
FROM nvcr.io/nvidia/tritonserver:24.10-py3

# The image's Python (3.10) runs our Python-based backends; the stub sees its dist-packages.
RUN pip install --no-cache-dir torch diffusers==0.42.1 transformers safetensors numpy pillow

# The core is imported as the `backends` package from /opt/easel; each backends/easel_*/model.py
# is a Python-based backend that Triton finds next to its own backends.
COPY backends /opt/easel/backends
RUN cp -r /opt/easel/backends/easel_* /opt/tritonserver/backends/
ENV PYTHONPATH=/opt/easel

EXPOSE 8000 8001 8002
ENTRYPOINT ["tritonserver", "--model-repository=/models", "--strict-readiness=true", "--exit-on-error=true"]
