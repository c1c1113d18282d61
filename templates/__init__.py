"""Triton templates and their Inductor lowerings for the kvq ops (installed as `kvq_compile.templates`).

The GPU templates are the subject of the GPU issue; until they land, the kvq ops run their reference
implementations (kvq_compile/ops.py) inside compiled graphs as opaque kernels.
"""
