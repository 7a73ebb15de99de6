"""Nsight Compute profiles of one kernel (bench/ncu/norm.sh, bench/ncu/matmul.sh, each running its target module
under ncu) and their summary (`python -m bench.ncu.summary`), written under bench/results/<gpu>/ncu/."""
