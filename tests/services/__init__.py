"""Tests of the gRPC services; :mod:`services.harness` runs them as separate processes."""
