"""Tests of the deployment artifacts: images, compose, Kubernetes manifests, configuration docs."""
