#!/usr/bin/env bash
# Speculative generation with the demo model pair (see README). Extra flags go to `specinfer demo`.
source "$(dirname "$0")/env.sh"
exec specinfer demo "$@"
