"""An offline kit for an air-gapped GPU node with a fixed image.

``make gpu-kit`` (``python -m bertdist.gpu_kit.build``) writes wheels for what the image lacks,
pre-built benchmark records and ``run.sh``; on the node, ``bash KIT/run.sh OUTDIR`` records the
environment, installs the kit offline, builds the CUDA extension and DeepSpeed's fused LAMB, and
runs ``bertdist bench`` against a deadline. docs/gpu-node.md is the walk-through.
"""
