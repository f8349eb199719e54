#!/usr/bin/env bash
# Prints jaxquant.cli.bench.source_digest() of the checkout this script lies in, without importing
# jaxquant (no built extension needed): sha1 of the Python and C++/CUDA sources under csrc/ and
# jaxquant/, concatenated in byte-sorted path order; first 12 hex digits. Reports name the measured
# code by it, since a working tree copied onto a device machine can keep a stale git HEAD.
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc jaxquant -type f \( -name '*.py' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) \
  | LC_ALL=C sort | tr '\n' '\0' | xargs -0 cat | sha1sum | cut -c1-12
