"""Launch paths: where `python -m rlcore.run` runs (Ray Jobs, KubeRay, Slurm); see docs/scale_out.md."""
