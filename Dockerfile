# The product's image: llm-epp (the EPP), llm-epp-trainer and llm-epp-predictor. The Helm chart
# runs the EPP and its sidecars from it with different commands. The lab (lab/: the simulated
# vLLM server, the fleet simulator, the local stack and the benchmarks, the llm-epp-lab
# distribution) is not in it.
#   make image            (docker build -t llm-epp:0.1.0 .)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN python -m venv /opt/llm-epp
COPY pyproject.toml README.md ./
COPY locks/venv.txt locks/
COPY epp epp
COPY trainer trainer
COPY predictor predictor
COPY wire wire
# A regular (non-editable) install, pinned by the same lock as `make install`: the final stage
# needs only the virtual environment. opentelemetry-proto goes last: xds-protos ships an older
# copy of its modules in the same files (see the Makefile).
RUN /opt/llm-epp/bin/pip install --no-cache-dir -c locks/venv.txt --upgrade pip \
 && PIP_CONSTRAINT=locks/venv.txt /opt/llm-epp/bin/pip install --no-cache-dir . \
 && PIP_CONSTRAINT=locks/venv.txt /opt/llm-epp/bin/pip install --no-cache-dir --no-deps --force-reinstall opentelemetry-proto \
 && /opt/llm-epp/bin/pip uninstall -y pip

FROM ${PYTHON_IMAGE}
# mimalloc: the EPP's tokenizer spends about half its time in glibc's malloc (lab/sim/processes.py).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libmimalloc2.0 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 llm-epp \
 && useradd --system --uid 10001 --gid llm-epp --no-create-home --home-dir /nonexistent llm-epp
COPY --from=build /opt/llm-epp /opt/llm-epp
ENV PATH=/opt/llm-epp/bin:$PATH \
    LD_PRELOAD=libmimalloc.so.2 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
# ext_proc, gRPC health, metrics; trainer; first predictor
EXPOSE 9002 9003 9090 8000 8001
CMD ["llm-epp", "--help"]
