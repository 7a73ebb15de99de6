"""The benchmarks, run on a GPU from the repository root as modules: `python -m bench.norms`,
`python -m bench.probes.gemm_sm90_configs`, `bench/sanitize.sh`. bench/NOTES.md says what each found."""
