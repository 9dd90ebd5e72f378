#!/usr/bin/env bash
# Prepares the GPU check's wheels, here, where pip reaches PyPI (the GPU machine reaches
# nothing): .whl/ gets rankscope itself and what that machine's image lacks, built for its
# Python 3.12 (torch 2.11.0+cu130, prometheus-client, nvidia-ml-py, numpy, PyYAML, grpcio and
# requests are there already). Then, on the GPU machine, carrying .whl: bash tests/gpu/run.sh
#
#   bash tests/gpu/prepare.sh        # ~1.5 MB in .whl/ (ignored by git)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-.venv/bin/python}
rm -rf .whl
mkdir -p .whl
"$python" -m pip wheel -q --no-deps --no-build-isolation -w .whl .
# One version of each, the versions the project's own environment resolves to today.
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    bcrypt==5.0.0 protobuf==7.36.2 googleapis-common-protos==1.76.0 importlib_metadata==9.1.0 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp==1.45.2 \
    opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
    opentelemetry-exporter-otlp-proto-http==1.45.2 2>&1 | grep -v "^WARNING: Location" || true
ls .whl
